"""Certify steps/s of this checkout against a baseline commit, side by side on the same machine.

    .venv/bin/python scripts/certify_speed.py --base b974eca [--target kvcert.gpu:factory ...] [CELL OPTIONS]

Builds the baseline commit as a wheel into a bare site-packages (as scripts/same_from_wheel.sh
does), then runs `kvcert certify TARGET` from the baseline and from this checkout in alternation —
baseline, new, new, baseline, so a machine that slows down or speeds up during the run weighs on
both alike — with the same seed, budget and cell options, and prints per target each side's
steps/s (steps over the cells' own seconds), the ratio, and whether every cell's op digest is the
same on both sides (`kvcert same`): equal digests mean the two generated the very same traces,
so the ratio compares equal work; where the generator changed, it also prints the ratio of the
times each side took for the same budget (examples per cell). Extra arguments go to both
`kvcert certify` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def install(rev: str, where: Path) -> Path:
    src, dist, site = where / "src", where / "dist", where / "site-packages"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "--prefix=src/"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    pip = [PY, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], check=True)
    (wheel,) = dist.glob("kvcert-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    return site


def certify(site: Path | None, target: str, out: Path, args: list[str], cwd: Path) -> dict:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    code = (
        "import os, sys, kvcert.conformance.cli as cli\n"
        "site = os.environ.get('PYTHONPATH')\n"
        "assert site is None or cli.__file__.startswith(site), cli.__file__\n"
        "sys.argv[0] = 'kvcert'\n"
        "cli.main()\n"
    )
    cmd = [PY, "-c", code, "certify", target, "--json", str(out), "--out", str(cwd / "failures"), *args]
    subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, check=False)
    return json.loads(out.read_text())


def rate(cert: dict) -> tuple[int, float]:
    cells = cert["cells"]
    return sum(c["steps"] for c in cells), sum(c["seconds"] for c in cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the baseline commit")
    ap.add_argument("--target", action="append", help="MODULE:FACTORY (default: kvcert.gpu and kvcert.refimpl)")
    ap.add_argument("--rounds", type=int, default=1, help="baseline/new/new/baseline rounds per target")
    opts, extra = ap.parse_known_args()
    targets = opts.target or ["kvcert.gpu:factory", "kvcert.refimpl:factory"]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        base_site = install(opts.base, tmp)
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
        print(f"baseline {opts.base}, new {head.stdout.strip()}{' (modified)' if dirty.stdout.strip() else ''}")
        print(f"certify options: {' '.join(extra) or '(defaults)'}")
        for target in targets:
            totals = {"baseline": [0, 0.0], "new": [0, 0.0]}
            certs: dict[str, Path] = {}
            for r in range(opts.rounds):
                for side in ("baseline", "new", "new", "baseline"):
                    out = tmp / f"{side}-{r}-{len(certs)}.json"
                    cert = certify(base_site if side == "baseline" else None, target, out, extra, tmp)
                    steps, secs = rate(cert)
                    totals[side][0] += steps
                    totals[side][1] += secs
                    certs.setdefault(side, out)
            b, n = (totals[s][0] / totals[s][1] for s in ("baseline", "new"))
            (bs, bt), (ns, nt) = totals["baseline"], totals["new"]
            same = subprocess.run(
                [PY, "-m", "kvcert.conformance.cli", "same", str(certs["baseline"]), str(certs["new"])],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            verdict = "same traces" if same.returncode == 0 else "other traces: the generator changed"
            print(
                f"{target}: baseline {b:.0f} steps/s ({bs // 2} steps in {bt / 2:.1f}s a run), "
                f"new {n:.0f} steps/s ({ns // 2} steps in {nt / 2:.1f}s a run); "
                f"steps/s {n / b:.2f}x, time for the same examples {bt / nt:.2f}x ({verdict})"
            )


if __name__ == "__main__":
    main()
