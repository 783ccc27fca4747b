"""Build + read a cache with a tiny random target: round trip, validation, integrity, resume."""
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch

from deepspec.cache import CacheCorruptError, CacheError, CacheMismatchError, CacheReader
from deepspec.cache import cli
from deepspec.cache.format import INDEX, MANIFEST, SCHEMA_META_KEY, sha256_file, shard_name, sidecar_name
from deepspec.cache.writer import build_cache
from deepspec.cache.finalize import finalize_cache
from deepspec.cache.capture import capture_batch, length_batches, pad_token_id, tokenize_records
from tests.support.synthetic import write_regen_jsonl
from deepspec.config import load_config
from deepspec.targets import TargetAdapter, load_target

N = 22
BASE = ["target.path=tiny:llama", "target.dtype=float32", "cache.shard_samples=4", "data.max_length=96",
        "cache.batch_tokens=200", "cache.encode_threads=2"]


def _cfg(run_dir, *extra):
    return load_config(BASE + [f"run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target(_cfg("/tmp/unused").target)


@pytest.fixture(scope="module")
def built(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("cache")
    regen = write_regen_jsonl(root / "regen" / "regen.jsonl", N, seed=1, max_words=12)
    # one blank line and one conversation without assistant tokens in the input
    lines = regen.read_text().splitlines()
    lines[5] = ""
    lines[9] = json.dumps({"id": "noasst", "conversations": [{"role": "user", "content": "hi"}], "meta": {}})
    regen.write_text("\n".join(lines) + "\n")
    cfg = _cfg(root)
    out = build_cache(cfg, target=target, progress=False)
    return cfg, out, regen


def _tree_copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_roundtrip_bit_exact(built, target):
    cfg, out, regen = built
    r = CacheReader(out)
    assert len(r) == N - 2 and r.manifest["skipped"]["count"] == 1
    assert r.manifest["skipped"]["examples"][0]["id"] == "noasst"
    assert 5 not in r.sample_indices and 9 not in r.sample_indices
    # reference: the same shard batching, captured directly
    lines = regen.read_bytes().splitlines(keepends=True)
    expect = {}
    for k in range(r.manifest["source"]["num_records"] // 4 + 1):
        recs = [(i, lines[i]) for i in range(4 * k, min(4 * k + 4, len(lines))) if lines[i].strip()]
        items = tokenize_records(target, recs, regen, 96, "error", [])
        for batch in length_batches(items, 200):
            f, h, lse = capture_batch(target, batch, pad_token_id(target))
            for b, it in enumerate(batch):
                t = len(it["ids"])
                expect[it["index"]] = (it, f[b, :t], h[b, :t], lse[b, :t])
    assert sorted(expect) == r.sample_indices.tolist()
    for i in range(len(r)):
        s = r[i]
        it, f, h, lse = expect[int(r.sample_indices[i])]
        assert s["input_ids"].dtype == torch.long and s["loss_mask"].dtype == torch.bool
        assert s["features"].dtype == torch.bfloat16 and s["last_hidden"].dtype == torch.bfloat16
        assert s["input_ids"].tolist() == it["ids"].tolist()
        assert s["loss_mask"].tolist() == it["mask"].astype(bool).tolist()
        assert torch.equal(s["features"].view(torch.int16), f.view(torch.int16))
        assert torch.equal(s["last_hidden"].view(torch.int16), h.view(torch.int16))
        assert s["features"].shape == (len(it["ids"]), target.feature_dim)
        # target_lse: logsumexp of the fp32 logits of the stored last_hidden, exactly as captured
        assert r.has_target_lse and s["target_lse"].dtype == torch.float32
        assert torch.equal(s["target_lse"], lse)
        ref = torch.logsumexp(target.logits_from_hidden(s["last_hidden"].float(), dtype=torch.float32), -1)
        assert torch.allclose(s["target_lse"], ref, atol=1e-4)
        assert r.num_tokens(i) == len(it["ids"]) == int(r.lengths[i])
        assert r.sample_id(i) == json.loads(lines[int(r.sample_indices[i])])["id"]
    # the stored tokens are what encode_chat gives (truncated to data.max_length)
    rec = json.loads(lines[0])
    enc = target.encode_chat(rec["conversations"])
    assert r[0]["input_ids"].tolist() == enc.input_ids[:96]
    # padded batching leaves real tokens' features as computed alone (up to float noise)
    alone = target.capture(torch.tensor([enc.input_ids[:96]])).features[0].to(torch.bfloat16)
    assert torch.allclose(alone.float(), r[0]["features"].float(), atol=1e-2, rtol=1e-2)
    assert r[-1]["input_ids"].numel() == r.num_tokens(len(r) - 1)
    with pytest.raises(IndexError):
        r[len(r)]


def test_manifest_contents(built, target):
    _, out, _ = built
    m = json.loads((out / MANIFEST).read_text())
    assert m["layer_ids"] == target.layer_ids and m["hidden_size"] == 64
    assert m["feature_dim"] == len(target.layer_ids) * 64
    assert m["index_convention"].startswith("decoder_layer_output")
    assert m["target"]["weights_sha256"] == target.fingerprint()["weights_sha256"]
    assert m["codec"] == {"name": "bf16", "params": {"layout": "planes_cm", "level": 1}}
    assert len(m["shards"]) == 6 and sum(s["samples"] for s in m["shards"]) == m["num_samples"]
    for s in m["shards"]:
        assert sha256_file(out / s["file"]) == s["sha256"]
    assert not list(out.glob(".tmp-*"))


def test_validate_refuses_mismatch(built, target):
    _, out, _ = built
    r = CacheReader(out)
    r.validate(target)
    r.validate({"layer_ids": target.layer_ids, "hidden_size": 64})
    other_layers = TargetAdapter(target.model, target.tokenizer, layer_ids=[0, 1])
    with pytest.raises(CacheMismatchError, match="layer_ids"):
        r.validate(other_layers)
    with pytest.raises(CacheMismatchError, match="weights_sha256"):
        r.validate({**target.fingerprint(), "weights_sha256": "0" * 64})
    with pytest.raises(CacheMismatchError, match="chat_template_sha256"):
        r.validate({"target": {"chat_template_sha256": "f" * 64}})
    with pytest.raises(CacheMismatchError, match="hidden_size: cache has 64, expected 128"):
        r.validate({"hidden_size": 128})
    with pytest.raises(CacheError, match="nothing to compare"):
        r.validate({"unrelated": 1})


def test_rebuild_is_noop_and_other_build_refused(built, target, tmp_path):
    cfg, out, regen = built
    before = (out / MANIFEST).read_bytes()
    assert build_cache(cfg, target=target, progress=False) == out
    assert (out / MANIFEST).read_bytes() == before
    cfg2 = _cfg(cfg.run_dir, "data.max_length=64")
    with pytest.raises(CacheMismatchError, match="max_length"):
        build_cache(cfg2, target=target, progress=False)


def test_corrupt_shard_named_by_verify_and_reader(built, tmp_path, capsys):
    _, out, _ = built
    d = _tree_copy(out, tmp_path / "c")
    assert cli.main(["verify", str(d)]) == 0
    victim = d / shard_name(2)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", str(d), "-q"]) == 1
    err = capsys.readouterr().err
    assert "shard-000002.arrow" in err and "sha256 mismatch" in err
    r = CacheReader(d)
    bad = [i for i in range(len(r)) if int(r._shard_of[i]) == 2]
    errors = []
    for i in bad:
        try:
            r[i]
        except CacheCorruptError as e:
            errors.append(str(e))
    assert errors and all("shard-000002.arrow" in e for e in errors)
    # truncation is caught when opening
    victim.write_bytes(bytes(data[:-10]))
    with pytest.raises(CacheCorruptError, match="shard-000002.arrow"):
        CacheReader(d)


def test_reader_refuses_mixed_codecs(built, tmp_path):
    _, out, _ = built
    d = _tree_copy(out, tmp_path / "mix")
    p = d / shard_name(1)
    table = pa.ipc.open_file(pa.py_buffer(p.read_bytes())).read_all()  # not mmap: p is rewritten
    meta = json.loads(table.schema.metadata[SCHEMA_META_KEY])
    meta["codec"] = {"name": "bf16", "params": {"layout": "plain", "level": 1}}
    table = table.replace_schema_metadata({SCHEMA_META_KEY: json.dumps(meta).encode()})
    with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    m = json.loads((d / MANIFEST).read_text())
    m["shards"][1].update(bytes=p.stat().st_size, sha256=sha256_file(p))
    (d / MANIFEST).write_text(json.dumps(m))
    r = CacheReader(d)
    i = int(np.flatnonzero(r._shard_of == 1)[0])
    with pytest.raises(CacheCorruptError, match="never mixes codecs"):
        r[i]


def test_version_1_caches_stay_readable(built, tmp_path, capsys):
    """A cache written before ``target_lse`` existed (format version 1: no such column) still opens,
    verifies and decodes; its samples simply carry no ``target_lse``."""
    _, out, _ = built
    d = _tree_copy(out, tmp_path / "v1")
    m = json.loads((d / MANIFEST).read_text())
    for k, sh in enumerate(m["shards"]):
        p = d / sh["file"]
        table = pa.ipc.open_file(pa.py_buffer(p.read_bytes())).read_all().drop_columns(["target_lse"])
        with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
        sh.update(bytes=p.stat().st_size, sha256=sha256_file(p))
    m["format_version"] = 1
    (d / MANIFEST).write_text(json.dumps(m))
    r, new = CacheReader(d), CacheReader(out)
    assert not r.has_target_lse and new.has_target_lse
    assert r.verify(decode=True) == []
    old_s, new_s = r[3], new[3]
    assert "target_lse" not in old_s and "target_lse" in new_s
    assert torch.equal(old_s["last_hidden"].view(torch.int16), new_s["last_hidden"].view(torch.int16))
    assert cli.main(["info", str(d)]) == 0
    assert "not stored (format version 1)" in capsys.readouterr().out
    m["format_version"] = 3
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CacheCorruptError, match="format_version 3 is not supported"):
        CacheReader(d)


def test_info_output(built, capsys):
    _, out, _ = built
    assert cli.main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in ("samples          20", "bytes/token", "raw layout       646 bytes/token", "compression",
                   "x vs raw layout", '"codec"', '"weights_sha256"', "manifest:"):
        assert needle in text
    assert cli.main(["info", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"]["samples"] == 20 and doc["stats"]["ratio_vs_raw"] > 1.0
    assert cli.main(["info", str(out / "nope")]) == 1


def test_info_reports_draft_vocabulary_coverage(built, target, capsys):
    """Coverage of the answer tokens by the N most frequent, for the standard sizes and --vocab-size."""
    import numpy as np
    from deepspec.data.vocab import count_answer_tokens, coverage, select_top
    _, out, _ = built
    reader = CacheReader(out)
    counts = count_answer_tokens((reader.tokens(i) for i in range(len(reader))), target.vocab_size)
    distinct = int(np.count_nonzero(counts))
    assert 8 < distinct < target.vocab_size
    assert cli.main(["info", str(out), "--json", "--vocab-size", "8", "--vocab-size", str(distinct)]) == 0
    cov = json.loads(capsys.readouterr().out)["draft_vocab_coverage"]
    assert cov["answer_tokens"] == int(counts.sum()) == int(reader.loss_lengths.sum())
    assert cov["distinct"] == distinct
    assert cov["coverage"]["8"] == pytest.approx(coverage(counts, select_top(counts, 8)))
    assert 0 < cov["coverage"]["8"] < 1
    assert cov["coverage"][str(distinct)] == cov["coverage"]["8192"] == 1.0
    assert cli.main(["info", str(out), "--vocab-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "draft vocab" in text and "N=8: " in text and "N=32,768: 100.00%" in text
    assert cli.main(["info", str(out), "--no-coverage"]) == 0
    assert "draft vocab" not in capsys.readouterr().out
    assert cli.main(["info", str(out), "--vocab-size", "0"]) == 1
    assert "--vocab-size 0" in capsys.readouterr().err


def test_resume_from_crash_leftovers_is_byte_identical(built, target, tmp_path):
    cfg, out, regen = built
    d = _tree_copy(out, tmp_path / "crashed")
    # what a kill -9 can leave: no manifest/index, a shard without its sidecar, a temp
    # shard, a committed sidecar whose shard file was cut short, a half-written sidecar temp
    for name in (MANIFEST, INDEX, sidecar_name(1)):
        (d / name).unlink()
    (d / ".tmp-r0-4242-shard-000003.arrow").write_bytes(b"ARROW1 half")
    (d / ".tmp-r0-4242-shard-000003.json").write_bytes(b"{")
    s4 = d / shard_name(4)
    s4.write_bytes(s4.read_bytes()[:100])
    cfg2 = _cfg(tmp_path / "run2", f"cache.dir={d}")
    with pytest.raises(CacheError, match="no manifest.json"):
        CacheReader(d)
    assert finalize_cache(d) is False
    build_cache(cfg2, regen_path=regen, target=target, progress=False)
    a, b = json.loads((out / MANIFEST).read_text()), json.loads((d / MANIFEST).read_text())
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert not list(d.glob(".tmp-*"))
    ra, rb = CacheReader(out), CacheReader(d)
    for i in range(len(ra)):
        x, y = ra[i], rb[i]
        assert all(torch.equal(x[k].view(torch.int16) if x[k].is_floating_point() else x[k],
                               y[k].view(torch.int16) if y[k].is_floating_point() else y[k]) for k in x)


def test_two_ranks_equal_one_rank(built, target, tmp_path):
    cfg, out, regen = built
    cfg2 = _cfg(tmp_path / "two")
    d = None
    for rank in (1, 0):  # either rank may finish last and write the manifest
        d = build_cache(cfg2, regen_path=regen, target=target, rank=rank, world_size=2, wait=False,
                        progress=False)
        assert (d / MANIFEST).is_file() == (rank == 0)
    a, b = json.loads((out / MANIFEST).read_text()), json.loads((d / MANIFEST).read_text())
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert (out / INDEX).read_bytes() == (d / INDEX).read_bytes()


def test_bad_records(target, tmp_path):
    regen = write_regen_jsonl(tmp_path / "r.jsonl", 5, seed=3, max_words=12)
    lines = regen.read_text().splitlines()
    lines[2] = "{not json"
    lines[3] = json.dumps({"id": "robot", "conversations": [{"role": "robot", "content": "beep"}]})
    regen.write_text("\n".join(lines) + "\n")
    with pytest.raises(CacheError, match=r"r\.jsonl:3: not valid JSON.*on_error=skip"):
        build_cache(_cfg(tmp_path / "e", "data.on_error=error"), regen_path=regen, target=target, progress=False)
    out = build_cache(_cfg(tmp_path / "s", "data.on_error=skip"), regen_path=regen, target=target,
                      progress=False)
    r = CacheReader(out)
    assert len(r) == 3 and r.manifest["skipped"]["count"] == 2
    reasons = " ".join(x["reason"] for x in r.manifest["skipped"]["examples"])
    assert "r.jsonl:4: cannot encode the conversation" in reasons and "role" in reasons
    with pytest.raises(CacheError, match="not found"):
        build_cache(_cfg(tmp_path / "m"), regen_path=tmp_path / "missing.jsonl", target=target)


def test_reader_pickles_for_dataloader_workers(built):
    import pickle
    _, out, _ = built
    r = CacheReader(out)
    r[0]
    r2 = pickle.loads(pickle.dumps(r))
    assert torch.equal(r2[3]["features"].view(torch.int16), r[3]["features"].view(torch.int16))
    assert os.getpid() == r2._pid


# -- fuzzing: garbage manifests / flipped shard bytes only ever raise the project's errors -------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)
_FUZZ = settings(max_examples=25, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _read_all(d):
    r = CacheReader(d)
    return [r[i] for i in range(len(r))]


@pytest.fixture(scope="module")
def originals(built):
    _, out, _ = built
    return _read_all(out)


@_FUZZ
@given(where=st.sampled_from(["top", "target", "codec", "index", "shard"]), key_pick=st.integers(0, 100),
       value=_json, raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_fuzz_manifest(built, originals, tmp_path_factory, where, key_pick, value, raw):
    """A damaged manifest is refused with a `CacheError`, or (a field the reader does not need) read back
    to exactly the original samples: never another exception, never different values."""
    _, out, _ = built
    d = _tree_copy(out, tmp_path_factory.mktemp("fm") / "c")
    if raw is not None and key_pick % 5 == 0:
        (d / MANIFEST).write_bytes(raw)
    else:
        m = json.loads((d / MANIFEST).read_text())
        node = {"top": m, "target": m["target"], "codec": m["codec"], "index": m["index"],
                "shard": m["shards"][key_pick % len(m["shards"])]}[where]
        keys = sorted(node)
        node[keys[key_pick % len(keys)]] = value
        (d / MANIFEST).write_text(json.dumps(m))
    try:
        got = _read_all(d)
    except CacheError:
        return
    assert len(got) == len(originals)
    for a, b in zip(originals, got):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@_FUZZ
@given(which=st.integers(0, 6), pos=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255))
def test_fuzz_shard_and_index_bytes(built, originals, tmp_path_factory, which, pos, flip):
    _, out, _ = built
    d = _tree_copy(out, tmp_path_factory.mktemp("fs") / "c")
    victim = d / (INDEX if which == 6 else shard_name(which))
    data = bytearray(victim.read_bytes())
    data[int(pos * len(data))] ^= flip
    victim.write_bytes(bytes(data))
    try:
        got = _read_all(d)
    except CacheCorruptError:
        return
    for a, b in zip(originals, got):  # a flip that is not caught must not change any value
        for k in a:
            x, y = a[k], b[k]
            if x.is_floating_point():
                x, y = x.view(torch.int16), y.view(torch.int16)
            assert torch.equal(x, y)
    assert cli.main(["verify", str(d), "-q"]) == (0 if which == 6 else 1)
