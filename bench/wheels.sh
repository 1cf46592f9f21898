#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) every wheel the GPU image lacks for bench/ and sfttrain:
# gpu-wheels' own omegaconf and liger-kernel, TRL for bench/trl_w1.py, datasets (TRL imports it)
# and datasets' two needs the image lacks, dill and multiprocess, torchao for model.fp8
# (bench/fp8_w2b.py; no Requires-Dist of its own), and bitsandbytes for TRL's QLoRA (bench/lora_w2b.py's
# trl_qlora; needs torch, numpy, packaging). Every other Requires-Dist of
# these wheels is in the image (/work/.library/device/KINDS.md, "Python packages already there"):
# accelerate, transformers, pyarrow>=24 (25.0.1), huggingface-hub>=1.31 (1.33.0), pandas, fsspec
# (<=2026.9.0, the newest release), xxhash, jinja2, psutil, pyyaml, torch, triton, ...
# Run from anywhere in the checkout; prints each wheel's requirements and the total size.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
mkdir -p "$(git rev-parse --git-path info)"  # gpu-wheels appends /.whl/ to info/exclude there
# bitsandbytes' only wheel is tagged manylinux_2_24, a tag gpu-wheels does not ask for (pip matches it exactly)
"$top/../shared/tools/gpu-wheels" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0 \
  --platform manylinux_2_24_x86_64 bitsandbytes==0.50.2 >/dev/null
# bitsandbytes' wheel holds a library for every CUDA, ROCm and XPU release (43 MB); the image's torch is CUDA 13's,
# whose library it loads (libbitsandbytes_cuda130.so): the others leave the wheel and its RECORD, for the
# carried tree to stay under the device tool's 64 MiB
python3 - .whl/bitsandbytes-0.50.2-*.whl <<'PY'
import os, re, sys, zipfile

def keep(name):
    return not re.search(r"libbitsandbytes_(cuda1[12]|rocm|xpu)", name)

with zipfile.ZipFile(sys.argv[1]) as whl:
    if all(map(keep, whl.namelist())):
        sys.exit()
    with zipfile.ZipFile(sys.argv[1] + ".part", "w", zipfile.ZIP_DEFLATED) as out:
        for info in filter(lambda i: keep(i.filename), whl.infolist()):
            data = whl.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(True) if keep(line.decode()))
            out.writestr(info, data)
os.replace(sys.argv[1] + ".part", sys.argv[1])
PY

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
