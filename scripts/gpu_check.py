"""Check the GPU path on one machine in a few minutes: NCCL ranks, bf16, the three backends, a budget sweep.

    python scripts/gpu_check.py --out DIR            # on a GPU machine (about 5 minutes on one H200)
    python scripts/gpu_check.py --out DIR --device cpu   # the same logic on CPU (gloo, 2 ranks)

Writes DIR/summary.json (environment, agreement of the backends, the sweep's
tok/s) and leaves each run's results.json under DIR/runs. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def harness(*args: str, timeout: float) -> tuple[int, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    t0 = time.perf_counter()
    print("+ python -m harness", " ".join(args), flush=True)
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, env=env, timeout=timeout)
    return proc.returncode, time.perf_counter() - t0


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for dist_name in ("transformers", "peft", "megatron-core", "hydra-core", "flash-linear-attention"):
        try:
            from importlib import metadata

            info[dist_name] = metadata.version(dist_name)
        except Exception:  # noqa: BLE001
            info[dist_name] = None
    return info


def agreement(sweep: Path, dtype: str) -> dict:
    """Per-example losses and gradient norms of every backend against pytorch's."""
    runs = {}
    for res_file in sorted(sweep.glob("*/results.json")):
        res = load(res_file)
        out_file = res_file.parent / "example_outputs.json"
        runs[res["backend"]] = {
            "status": res["status"],
            "error": res["error"],
            "outputs": load(out_file) if out_file.exists() else None,
            "plan": res.get("plan"),
        }
    rtol = 1e-4 if dtype == "float32" else 3e-2
    ref = runs.get("pytorch", {}).get("outputs")
    report = {"dtype": dtype, "rtol": rtol, "backends": {}}
    for name, run in runs.items():
        entry = {"status": run["status"], "error": run["error"]}
        if ref and run["outputs"]:
            a, b = run["outputs"]["forward_backward"], ref["forward_backward"]
            worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a["loss"], b["loss"]))
            entry["max_rel_loss_diff"] = worst
            entry["rel_grad_norm_diff"] = abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
            entry["agrees"] = worst <= rtol and entry["rel_grad_norm_diff"] <= rtol
            entry["n_dummy"] = run["plan"]["n_dummy"] if run["plan"] else None
        report["backends"][name] = entry
    report["ok"] = bool(ref) and all(e.get("agrees") for e in report["backends"].values()) and len(runs) == 3
    return report


def sweep_table(sweep: Path) -> list[dict]:
    rows = []
    for res_file in sorted(sweep.glob("*/results.json"), key=lambda p: int(p.parent.name)):
        r = load(res_file)
        passes = r.get("passes", {})
        rows.append(
            {
                "backend": r["backend"],
                "mtpm": r["mtpm"],
                "mbs": r["mbs"],
                "status": r["status"],
                "fwd_tok_per_s": passes.get("forward", {}).get("tok_per_s"),
                "fwd_util_pct": passes.get("forward", {}).get("util_pct"),
                "fwdbwd_tok_per_s": passes.get("forward_backward", {}).get("tok_per_s"),
                "fwdbwd_util_pct": passes.get("forward_backward", {}).get("util_pct"),
                "mem_pct": passes.get("forward_backward", {}).get("mem_pct"),
                "mem_peak_bytes": passes.get("forward_backward", {}).get("mem_peak_bytes"),
                "pad_efficiency": (r.get("plan") or {}).get("pad_efficiency"),
                "n_microbatches": (r.get("plan") or {}).get("n_microbatches"),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto")
    ap.add_argument("--skip-sweep", action="store_true", help="only the agreement checks")
    args = ap.parse_args()
    out = args.out.resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    summary: dict = {"environment": environment(), "checks": {}, "wall_s": {}}
    common = [f"backend.device={args.device}", "workload=smoke", "bench.save_outputs=true", "bench.warmup=0", "bench.repeat=1"]
    ok = True
    # 1. The three backends agree, in float32 (tight) and in the model's own dtype (bf16 on GPU).
    for dtype in ("float32", "auto"):
        sweep = out / "runs" / f"agree_{dtype}"
        shutil.rmtree(sweep, ignore_errors=True)  # a rerun replaces this script's own runs (the harness keeps results)
        rc, wall = harness("-m", "backend=pytorch,fsdp2,megatron_ddp", "mtpm=700", f"model.dtype={dtype}", *common,
                           f"hydra.sweep.dir={sweep}", timeout=240)
        report = agreement(sweep, dtype if dtype == "float32" else ("bfloat16" if args.device == "auto" else "float32"))
        report["exit_code"] = rc
        summary["checks"][f"agree_{dtype}"] = report
        summary["wall_s"][f"agree_{dtype}"] = wall
        ok = ok and rc == 0 and report["ok"]
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # 2. The default budget sweep and the fixed-mbs baselines on fsdp2 (bf16 on GPU).
    if not args.skip_sweep:
        sweep = out / "runs" / "sweep"
        shutil.rmtree(sweep, ignore_errors=True)
        rc, wall = harness("-m", "backend=fsdp2", f"backend.device={args.device}", "mtpm=null,16384,32768,65536,131072",
                           f"hydra.sweep.dir={sweep}", timeout=300)
        rows = sweep_table(sweep)
        summary["checks"]["sweep"] = {"exit_code": rc, "rows": rows, "ok": rc == 0 and all(r["status"] == "ok" for r in rows)}
        summary["wall_s"]["sweep"] = wall
        ok = ok and summary["checks"]["sweep"]["ok"]
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v.get("ok") for k, v in summary["checks"].items()}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
