# Sourced by GPU jobs: `kernel_tests SECONDS LOG` runs every GPU kernel test (pytest marker
# `gpu`: tree kernels, top-k, the tree engine, the online widths, the MLA verify and drafter
# block attention kernels) into LOG and prints its last line. On a cold Triton cache they take
# ~4-5 minutes (compiles), warm ~3.
kernel_tests() {
  timeout "$1" python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_tree_engine.py \
    tests/test_online_widths.py tests/test_mla_verify.py tests/test_draft_attention.py > "$2" 2>&1
  tail -1 "$2"
}
