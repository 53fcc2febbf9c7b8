"""Build the nanochat_cpu wheel reproducibly and report whether build/dist changed.

Copies pyproject.toml and the package to a temporary directory (so stale files under the
checkout's build/ can never end up in the wheel), runs `pip wheel --no-deps` there with a fixed
SOURCE_DATE_EPOCH, and replaces <out>/<wheel> only when its bytes differ. Prints one JSON line:
{"wheel": path, "sha256": hex, "changed": bool}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--src", type=Path, required=True, help="repository root")
    p.add_argument("--out", type=Path, required=True, help="directory for the wheel")
    p.add_argument("--package", default="nanochat_cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
            if (args.src / name).is_file():
                shutil.copy2(args.src / name, src / name)
        shutil.copytree(args.src / args.package, src / args.package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        env = dict(os.environ, SOURCE_DATE_EPOCH="315532800", PYTHONHASHSEED="0")
        dist = Path(tmp) / "dist"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                        "--quiet", "--wheel-dir", str(dist), str(src)], check=True, env=env,
                       stdout=sys.stderr)
        (built,) = dist.glob(f"{args.package}-*.whl")
        args.out.mkdir(parents=True, exist_ok=True)
        dest = args.out / built.name
        changed = not dest.is_file() or sha256(dest) != sha256(built)
        if changed:
            shutil.copyfile(built, dest)
        for stale in args.out.glob(f"{args.package}-*.whl"):
            if stale.name != built.name:
                stale.unlink()
                changed = True
    print(json.dumps({"wheel": str(dest), "name": dest.name, "sha256": sha256(dest), "changed": changed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
