#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) every wheel the GPU image lacks for bench/ and sfttrain:
# gpu-wheels' own omegaconf and liger-kernel, TRL for bench/trl_w1.py, datasets (TRL imports it)
# and datasets' two needs the image lacks, dill and multiprocess, and torchao for model.fp8
# (bench/fp8_w2b.py; no Requires-Dist of its own). Every other Requires-Dist of
# these wheels is in the image (/work/.library/device/KINDS.md, "Python packages already there"):
# accelerate, transformers, pyarrow>=24 (25.0.1), huggingface-hub>=1.31 (1.33.0), pandas, fsspec
# (<=2026.9.0, the newest release), xxhash, jinja2, psutil, pyyaml, torch, triton, ...
# Run from anywhere in the checkout; prints each wheel's requirements and the total size.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
mkdir -p "$(git rev-parse --git-path info)"  # gpu-wheels appends /.whl/ to info/exclude there
"$top/../shared/tools/gpu-wheels" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0 >/dev/null

# pip refuses two versions of one package, so a stale wheel left in .whl/ must go first
dups=$(for f in .whl/*.whl; do basename "$f" | cut -d- -f1 | tr 'A-Z-' 'a-z_'; done | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "several versions in .whl/ of: $dups; delete the stale ones" >&2
  exit 1
fi
for f in .whl/*.whl; do
  needs=$(unzip -p "$f" '*.dist-info/METADATA' | awk '/^Requires-Dist:/ && !/extra ==/ {printf " %s", $2}')
  echo "$(basename "$f"):${needs:- none}"
done
du -ch .whl/*.whl | tail -1
