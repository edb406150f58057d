"""After ``make`` installs FBGEMM: one line saying whether its kernels run here.

``model.kernels=auto`` takes FBGEMM's kernels on CUDA where they run, else Triton's: a
build that does not match the installed torch (or the CPU build on a GPU machine) is not
an install failure, so this prints a warning and exits 0 either way.
"""

from __future__ import annotations

import torch

from dlrmflow.kernels import fbgemm_tbe


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    refusal = fbgemm_tbe.refusal(device)
    if refusal is None:
        print(f"fbgemm: {fbgemm_tbe.describe()} runs on {device} with torch {torch.__version__}")
    elif device == "cuda":
        print(
            f"warning: FBGEMM's kernels do not run on cuda ({refusal}); model.kernels=auto uses Triton"
        )
    else:
        print(
            f"warning: FBGEMM's kernels do not run here ({refusal}); model.kernels=fbgemm is unavailable"
        )


if __name__ == "__main__":
    main()
