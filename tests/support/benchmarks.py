"""Benchmark-shaped prompts for the tests, written for them (never the real benchmark files, which are read
from ``eval.data_dir`` and never copied into the repository): a few per benchmark name the evaluator knows,
each a list of user turns.  `write_benchmarks` lays them out as ``<dir>/<name>.jsonl`` files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

PROMPTS: Dict[str, List[List[str]]] = {
    'aime25': [
        ["Find the number of ordered pairs of positive integers (a, b) with a + b = 20 and gcd(a, b) = 1."],
        ["How many positive divisors does 360 have?"],
        ["Find the remainder when 7^100 is divided by 13."],
    ],
    'arena-hard-v2': [
        ["Compare SQL and NoSQL databases for a small web shop, with a recommendation."],
        ["Draft a polite email declining a meeting invitation because of a schedule conflict."],
        ["Explain the difference between a process and a thread, with an analogy."],
        ["Give a step-by-step plan to learn basic Spanish in three months."],
    ],
    'gsm8k': [
        ["A baker makes 24 muffins and sells 3 boxes of 6. How many muffins are left?"],
        ["Tom reads 12 pages a day. How many days does he need for a 180-page book?"],
        ["A shirt costs $20 and is 25% off. What is the new price?"],
        ["Sara has twice as many apples as Ben, who has 7. How many apples do they have together?"],
        ["A train leaves at 9:15 and arrives at 11:45. How long is the trip in minutes?"],
    ],
    'humaneval': [
        ["Write a Python function `is_palindrome(s: str) -> bool` that ignores case and spaces."],
        ["Write a Python function `running_max(xs: list[int]) -> list[int]` returning the maximum so far at each index."],
        ["Write a Python function `count_vowels(s: str) -> int`."],
        ["Write a Python function `flatten(nested: list) -> list` that flattens one level of nesting."],
    ],
    'livecodebench': [
        ["Given an array of integers, return the length of the longest strictly increasing contiguous subarray."],
        ["Given a string of parentheses, return the minimum number of insertions that make it balanced."],
        ["Given n, print the n-th Fibonacci number modulo 1,000,000,007."],
    ],
    'math500': [
        ["Find all real x such that x^2 - 5x + 6 = 0."],
        ["What is the sum of the interior angles of a hexagon, in degrees?"],
        ["Compute the greatest common divisor of 84 and 126."],
        ["Simplify (3/4) divided by (9/16)."],
    ],
    'mbpp': [
        ["Write a function to find the second largest number in a list."],
        ["Write a function to check whether a number is prime."],
        ["Write a function to reverse the words of a sentence."],
        ["Write a function that returns the factorial of n using a loop."],
    ],
    'mt-bench': [
        ["Write a short note inviting colleagues to a team lunch on Friday.", "Now make it more formal."],
        ["Explain what a hash table is to a beginner.", "Give one example of where it is used in practice."],
        ["Suggest three names for a bakery that sells bread and coffee.", "Pick the best one and explain why."],
        ["Summarise the water cycle in three sentences.", "Turn the summary into a short poem."],
    ],
}


def write_benchmarks(directory: Path) -> Path:
    """``directory/<benchmark>.jsonl`` for every benchmark above; returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in PROMPTS.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in rows))
    return directory
