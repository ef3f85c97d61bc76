"""Per-rank GPU time of the profiled 2 x H200 pipelining steps (data/validation/profiles/pp-ops-torch-*.json): the
step's span, the compute kernels' busy time and the NCCL time left exposed, for 1F1B, GPipe and interleaved 1F1B of
one shape, as notes section 35 quotes them.
    .venv/bin/python tools/pp_profile_summary.py [SHAPE_AND_PRECISION]     (default llama3-8b-L4*-bf16)"""
import glob
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "data" / "validation" / "profiles"


def main() -> None:
    pattern = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b-L4*-bf16"
    for f in sorted(glob.glob(str(ROOT / f"pp-ops-torch-*{pattern}.json"))):
        kind = Path(f).name.removeprefix("pp-ops-torch-").split("-")[0]
        for rank, t in enumerate(json.loads(Path(f).read_text())["timeline"]):
            print(f"{kind:15} rank {rank}: span {t['span_us'] / 1e3:6.1f} ms, compute busy {t['compute_busy_us'] / 1e3:6.1f}"
                  f" ms, NCCL exposed {t['nccl_exposed_us'] / 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
