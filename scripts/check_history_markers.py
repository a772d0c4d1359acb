#!/usr/bin/env python3
"""Fails when the tracked tree narrates its own history.

The code, tests, benchmarks, scripts and docs say what holds and why; when something was found, in
which session or round, and under which experiment code name belongs in commit messages and
CHANGELOG.md (../shared/design/style.md, "Comments say what holds and why"). This check scans
every tracked text file, and every tracked path, for such markers, prints `file:line: text` for each
one and exits 1 when it finds any (0 when none, 2 when git cannot list the files).

Where a marker may stand:
- CHANGELOG.md: anywhere (it is the history).
- this script, whose comments show the patterns it looks for.
- docs/design/*.md: the rows (`| ... |` lines) of a table under a heading that contains
  "Tried and not kept"; each row names the commit and the date of a rejected experiment.
- docs/perf/*.md, dates only: a perf page states the machine, driver, CUDA, commit and date of its
  current table on one line, which carries the label `Date:`, and lists earlier runs one line each
  (date, commit, headline figure) in a section headed "Earlier runs". A date elsewhere on a page is
  a diary entry.

Usage: scripts/check_history_markers.py [PATH ...]   (default: every tracked file)
"""
import re
import subprocess
import sys
from pathlib import Path

# Experiment code names (fit13, small17, nu14, l2pf3, cli16b, ...): a run prefix followed by one or
# two digits and at most one letter, as a word of its own. "CLI11", the command-line parser library,
# is a name, not a run: the code names are written in lower case.
CODE_NAME = r"\b(?:nu|fit|act|small|tick|h2s|epi|alu|dec|onl|wg|l2pf|sass|slot|cvt|pf|cli)[0-9]{1,2}[a-z]?\b"
MARKER = re.compile(
    r"\bsessions? [0-9]+"
    r"|\brounds? [0-9]+"
    r"|\bnew[- ]user (?:QA|trial|round|finding)"
    r"|\bQA round"
    r"|(?!CLI11\b)" + CODE_NAME,
    re.IGNORECASE,
)
DATE = re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")
HEADING = re.compile(r"^#{1,6}\s")
SELF = "scripts/check_history_markers.py"


def tracked_files(paths):
    out = subprocess.run(["git", "ls-files", "-z", "--", *paths], capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def read_text(path):
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def findings(path, text):
    is_design = re.fullmatch(r"docs/design/[^/]+\.md", path) is not None
    is_perf = re.fullmatch(r"docs/perf/[^/]+\.md", path) is not None
    heading = ""
    for n, line in enumerate(text.splitlines(), 1):
        if HEADING.match(line):
            heading = line
        if is_design and "tried and not kept" in heading.lower() and line.lstrip().startswith("|"):
            continue
        hit = MARKER.search(line)
        if not hit and DATE.search(line):
            date_allowed = is_perf and ("Date:" in line or "earlier runs" in heading.lower())
            if not date_allowed:
                hit = True
        if hit:
            yield n, line.strip()


def main(argv):
    try:
        files = tracked_files(argv[1:])
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"check_history_markers: cannot list the tracked files: {e}", file=sys.stderr)
        return 2
    count = 0
    for path in files:
        if path in ("CHANGELOG.md", SELF):
            continue
        if MARKER.search(path) or DATE.search(path):
            print(f"{path}:0: (the path itself)")
            count += 1
        text = read_text(path)
        if text is None:
            continue
        for n, line in findings(path, text):
            print(f"{path}:{n}: {line}")
            count += 1
    if count:
        print(f"check_history_markers: {count} history marker(s): rewrite each as the rule it protects, "
              "or delete it; provenance goes in the commit message or CHANGELOG.md", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
