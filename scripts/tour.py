"""Run the README's short tour and write what each command printed to docs/tour_output.md.

    python scripts/tour.py            # run every command of the tour (minutes), rewrite docs/tour_output.md
    python scripts/tour.py --check    # exit 1 if the page's commands are not the README's tour, in order

The tour is the README's first ```bash block under "## A short tour"; each line is run as written, from the
repository root, in order (the replay of step 4 reads the failure the zoo of step 3 saved). The page keeps, per
command, its exit status and the lines that carry its verdict (the certificate's summary, the zoo's table), so the
README's tour shows what the commands print today and never a figure typed by hand. tests/test_structure.py
runs `--check`: a tour edited in the README without a new page fails it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "tour_output.md"
KEEP = 40
"""Lines kept per command: its verdict and what it says it did not check, not the progress before them."""


def tour_commands(readme: str) -> list[str]:
    """The commands of the README's tour: its first bash block after "## A short tour", comments dropped."""
    section = readme[readme.index("## A short tour") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    if block is None:
        raise SystemExit("README.md: no ```bash block under '## A short tour'")
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def page_commands(page: str) -> list[str]:
    """The commands the page shows output for, in order."""
    return re.findall(r"^### `(.+)`$", page, re.M)


def verdict_lines(output: str) -> list[str]:
    """The part of a command's output worth keeping: from a certificate's verdict line (CERTIFIED, NOT CERTIFIED)
    on, at most KEEP lines; the last KEEP lines of a command that prints none."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    marks = [i for i, line in enumerate(lines) if re.match(r"(NOT )?CERTIFIED\b", line)]
    start = marks[-1] if marks else max(0, len(lines) - KEEP)
    return lines[start : start + KEEP]


def run(command: str) -> tuple[int, list[str]]:
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
    return done.returncode, verdict_lines(done.stdout + "\n" + done.stderr)


def render(results: list[tuple[str, int, list[str]]]) -> str:
    out = [
        "# The README's tour, as it printed",
        "",
        "Written by `python scripts/tour.py`, which runs each command of the README's short tour from the repository",
        "root, in order, and keeps its exit status and the lines that carry its verdict. Rerun it after a change that",
        "moves a verdict; `tests/test_structure.py` checks that the commands here are the README's.",
        "",
    ]
    for command, code, lines in results:
        out += [f"### `{command}`", "", f"exit status {code}", "", "```text", *lines, "```", ""]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the page's commands against the README")
    args = parser.parse_args()
    commands = tour_commands(README.read_text())
    if args.check:
        shown = page_commands(PAGE.read_text()) if PAGE.exists() else []
        if shown != commands:
            print(f"{PAGE.relative_to(ROOT)} shows {shown}, the README's tour is {commands}: run scripts/tour.py")
            return 1
        return 0
    results = []
    for command in commands:
        print(f"tour: {command}", flush=True)
        code, lines = run(command)
        results.append((command, code, lines))
    PAGE.write_text(render(results))
    print(f"tour: wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
