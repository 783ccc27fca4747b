"""Package layout (metadata is in pyproject.toml): conf/ and recipes/ sit at the repository root beside
deepspec/ and are mapped into the wheel as deepspec/conf and deepspec/recipes, so an installed wheel is
self-contained (deepspec.config.loader looks at the checkout first, then inside the package)."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["deepspec*"]) + ["deepspec.conf", "deepspec.recipes"],
      package_dir={"deepspec.conf": "conf", "deepspec.recipes": "recipes"})
