"""The GPU check (``make gpu-check``): everything that needs a CUDA device, in one go.

Run on a machine with a GPU after ``make`` has installed the CUDA builds of torch and
FBGEMM. In turn: the tests marked ``gpu`` and the Triton kernel tests (compiled for the
GPU, against their CPU twins); the demo trained on ``cuda:0`` in one rank and evaluated,
once under each TBE backend (FBGEMM's, Triton's, torch's ops; a backend that cannot run
here is recorded as skipped, with the reason); the kernel benchmark with CUDA tensors
(Triton TBE and interaction against plain torch and FBGEMM's TBE on the GPU). Each step
has a time limit, so the whole check ends within ~13 minutes; its results go to one JSON
file (``--out``), and the exit code is 1 when any step failed. On a machine without CUDA
it stops at once, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DLRMFLOW = [sys.executable, "-m", "dlrmflow"]
# Seconds per step: together under the 10 minutes the check may take.
LIMITS = {"tests": 240, "demo": 150, "kernels": 180}
BACKENDS = ("fbgemm", "triton", "torch")


def _run(name: str, command: list[str], out: Path, limit: str | None = None) -> dict:
    """One step: its exit code, time, and the tail of its output (kept in a log file).
    ``limit``: the ``LIMITS`` entry it runs under (default: its name's)."""
    began = time.perf_counter()
    log = out.parent / f"{name}.log"
    seconds = LIMITS[limit or name]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code = 124
        text = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {seconds} s"
        text = text if isinstance(text, str) else text.decode(errors="replace")
    log.write_text(text)
    return {
        "ok": code == 0,
        "exit_code": code,
        "seconds": round(time.perf_counter() - began, 1),
        "log": str(log),
        "tail": text.strip().splitlines()[-5:],
    }


def _test_counts(junit: Path) -> dict[str, int]:
    if not junit.is_file():
        return {}
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _machine() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_cores": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["bf16"] = torch.cuda.is_bf16_supported()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    from dlrmflow.kernels import fbgemm_tbe

    refusal = fbgemm_tbe.refusal("cuda")
    info["fbgemm"] = fbgemm_tbe.describe() if refusal is None else f"not usable: {refusal}"
    return info


def _backend_refusal(backend: str) -> str | None:
    """Why ``backend`` cannot train on this machine's GPU (None: it can)."""
    import torch

    from dlrmflow.kernels.backends import KernelUnavailable, check_kernels

    try:
        check_kernels(backend, torch.device("cuda", 0))
    except KernelUnavailable as e:
        return str(e)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-results/gpu_check.json", help="the JSON to write")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": _machine(), "steps": {}}
    if not report["machine"].get("gpu"):
        print("gpu-check: torch sees no CUDA device here; nothing was run", file=sys.stderr)
        out.write_text(json.dumps(report, indent=1) + "\n")
        return 1
    steps = report["steps"]

    junit = out.parent / "tests.xml"
    steps["tests"] = _run(
        "tests",
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
         "-m", "gpu or triton", "tests/"],
        out,
    )  # fmt: skip
    steps["tests"]["counts"] = _test_counts(junit)

    for backend in BACKENDS:
        step = f"demo_{backend}"
        refusal = _backend_refusal(backend)
        if refusal is not None:
            steps[step] = {"ok": True, "skipped": refusal, "seconds": 0.0}
            continue
        demo_dir = out.parent / step
        steps[step] = _run(
            step,
            [*DLRMFLOW, "demo", "--run-dir", str(demo_dir), "--set", "distributed.nproc=1",
             "--set", "train.device=cuda", "--set", f"model.kernels={backend}"],
            out,
            limit="demo",
        )  # fmt: skip
        for name in ("summary.json", "train_result.json", "eval.json"):
            path = demo_dir / name
            if path.is_file():
                steps[step][name.removesuffix(".json")] = json.loads(path.read_text())

    kernels_json = out.parent / "kernels.json"
    steps["kernels"] = _run(
        "kernels",
        [*DLRMFLOW, "bench", "kernels", "--device", "cuda", "--repeats", "5",
         "--json", str(kernels_json)],
        out,
    )  # fmt: skip
    if kernels_json.is_file():
        bench = json.loads(kernels_json.read_text())
        steps["kernels"]["ratios"] = bench.get("ratios")
        steps["kernels"]["ours_kernels"] = bench.get("ours_kernels")
        steps["kernels"]["fbgemm_ratios"] = bench.get("fbgemm_ratios")
        steps["kernels"]["fbgemm"] = bench.get("fbgemm")

    report["ok"] = all(step["ok"] for step in steps.values())
    out.write_text(json.dumps(report, indent=1) + "\n")
    for name, step in steps.items():
        state = "skipped" if "skipped" in step else ("ok" if step["ok"] else "FAILED")
        print(f"{name:<13} {state}  {step['seconds']} s")
    print(f"gpu-check: {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
