#!/usr/bin/env bash
# The course walked as a new learner does, from scratch, recorded with screenshots:
#   bash benchmarks/tools/walkthrough.sh [--only 00c-setup 03]
# A fresh clone of this repository in a temp folder, a new venv, `bash setup.sh` there, a fresh
# KIT_HOME, then benchmarks/tools/walkthrough.py drives JupyterLab in headless Chromium (Debian's
# chromium + pip's playwright, added to that venv only; no `playwright install`).
# Writes a record: benchmarks/records/<today>-course-walkthrough-cpu/ (report.md, walkthrough.json,
# screenshots/*.jpg; RECORD=... another folder).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
RECORD=${RECORD:-$HERE/benchmarks/records/$(date +%F)-course-walkthrough-cpu}
WORK=${WALKTHROUGH_DIR:-$(mktemp -d /tmp/walkthrough.XXXXXX)}
echo "walkthrough: work folder $WORK"
cleanup() {
  # walkthrough.py stops jupyter lab (its own session) and chromium; whatever of this walkthrough
  # is left (kernels, torchrun workers, the browser: all name $WORK on their command line) ends here.
  for pid in $(pgrep -f "$WORK/" || true); do
    [ "$pid" != "$$" ] && kill "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT INT TERM
command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
git clone -q "$HERE" "$WORK/clone"
cd "$WORK/clone"
python3 -m venv .venv
. .venv/bin/activate
t0=$(date +%s)
bash setup.sh
t1=$(date +%s)
pip install -q playwright  # the browser driver, outside the project's requirements
export KIT_HOME="$WORK/kit_home"
mkdir -p "$KIT_HOME"
python "$HERE/benchmarks/tools/walkthrough.py" --root "$WORK/clone" --out "$RECORD" \
  --command "bash benchmarks/tools/walkthrough.sh${*:+ $*}" \
  --setup "fresh clone, new venv, \`bash setup.sh\` in $((t1 - t0)) s, then \`pip install playwright\`; KIT_HOME=$KIT_HOME (empty)" "$@"
du -sh "$RECORD/screenshots"
