"""SGLang 0.5.23's Marlin MoE kernels without the rest of SGLang, and the bundle that carries
them to a GPU host that has no SGLang install.

Importing ``sglang.kernels.ops`` pulls in SGLang's top-level package; two of its imports
(IPython, sniffio) are only placeholders here, ``sgl_kernel``'s compiled ops are skipped (they
match only the torch they were built for), and the Marlin scale permutation is executed from
SGLang's own source without its module imports. ``--make-bundle`` (``make_bundle``) compiles
the JIT kernels for sm_90a on a host with nvcc and packs a trimmed copy of the SGLang package;
``load_sglang_kernels(bundle)`` on the GPU host routes ``load_jit`` to those prebuilt files.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
import types
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

_JIT_MODULES = ("moe_wna16_marlin", "moe_align", "moe_align_single_token", "gptq_marlin_repack")


def _install_placeholders() -> None:
    """Placeholders for two modules SGLang's top-level package imports but the kernels never use."""
    if importlib.util.find_spec("IPython") is None:
        ipy = types.ModuleType("IPython")
        disp = types.ModuleType("IPython.display")
        disp.HTML = lambda *a, **k: None
        disp.display = lambda *a, **k: None
        ipy.display = disp
        ipy.get_ipython = lambda: None  # matplotlib asks for a running shell
        sys.modules.setdefault("IPython", ipy)
        sys.modules.setdefault("IPython.display", disp)
    if importlib.util.find_spec("sniffio") is None:
        sn = types.ModuleType("sniffio")

        class AsyncLibraryNotFoundError(RuntimeError):
            pass

        def current_async_library():
            raise AsyncLibraryNotFoundError("placeholder")

        sn.AsyncLibraryNotFoundError = AsyncLibraryNotFoundError
        sn.current_async_library = current_async_library
        sys.modules.setdefault("sniffio", sn)


def _scalar_types():
    """``sgl_kernel.scalar_type.scalar_types`` without running ``sgl_kernel/__init__`` (which
    loads compiled ops that only match the torch they were built for)."""
    try:
        from sgl_kernel.scalar_type import scalar_types

        return scalar_types
    except ImportError:
        pass
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sgl_kernel is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "scalar_type.py"
    name = "sgl_kernel_scalar_type"
    mspec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[name] = mod
    mspec.loader.exec_module(mod)
    return mod.scalar_types


def _sglang_functions(relpath: str, names: Sequence[str], namespace: dict) -> dict:
    """Execute only the named top-level functions of an SGLang source file.

    Used for the pure-torch Marlin scale permutation in ``marlin_utils.py``, whose module
    imports reach far into SGLang's runtime; the functions themselves need only torch.
    """
    spec = importlib.util.find_spec("sglang")
    src_path = Path(list(spec.submodule_search_locations)[0]) / relpath
    tree = ast.parse(src_path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in body}
    if missing:
        raise ImportError(f"{relpath}: functions {sorted(missing)} not found")
    code = compile(ast.Module(body=body, type_ignores=[]), str(src_path), "exec")
    ns = dict(namespace)
    exec(code, ns)  # noqa: S102 - SGLang's own source, read from the installed package
    return {n: ns[n] for n in names}


def _use_prebuilt(modules: Sequence[types.ModuleType], jit_dir: Path) -> None:
    """Route each kernel module's ``load_jit`` to a prebuilt ``<module name>.so`` when one exists."""
    from sglang.kernels.jit.utils.compile import spec as _spec

    prefix = _spec._MODULE_NAME_PREFIX

    for mod in modules:
        real = mod.load_jit
        if getattr(real, "_prebuilt", False):
            continue

        def load(*args, _real=real, **kwargs):
            so = jit_dir / f"{prefix}{'_'.join(str(a) for a in args)}.so"
            if so.exists():
                from tvm_ffi import load_module

                try:
                    return load_module(str(so))
                except Exception as exc:  # fall back to compiling
                    print(f"[moe_verify] prebuilt {so.name} failed to load ({exc}); compiling", flush=True)
            return _real(*args, **kwargs)

        load._prebuilt = True
        mod.load_jit = load


def load_sglang_kernels(bundle: str | os.PathLike | None = None) -> SimpleNamespace:
    """Import SGLang's Marlin MoE, alignment and repack kernels (and nothing else of SGLang)."""
    if bundle:
        jit_dir = Path(bundle) / "jit"
    _install_placeholders()
    t0 = time.time()
    from sglang.kernels.ops.moe import (
        moe_align,
        moe_align_single_token,
        moe_align_small_numel,
        moe_wna16_marlin,
    )
    from sglang.kernels.ops.quantization import gptq_marlin_repack

    if bundle and jit_dir.is_dir():
        _use_prebuilt([moe_wna16_marlin, moe_align, moe_align_single_token, gptq_marlin_repack], jit_dir)
    perm = _sglang_functions(
        "srt/layers/quantization/marlin_utils.py",
        ["get_scale_perms", "marlin_permute_scales", "marlin_moe_permute_scales"],
        {"torch": torch},
    )
    return SimpleNamespace(
        marlin_gemm=moe_wna16_marlin.moe_wna16_marlin_gemm,
        align_jit=moe_align.moe_align_block_size,
        align_single_token=moe_align_single_token.moe_align_single_token,
        align_small_numel=moe_align_small_numel.moe_align_small_numel,
        small_numel_limit=moe_align_small_numel.SMALL_NUMEL_LIMIT,
        repack=gptq_marlin_repack.gptq_marlin_repack,
        permute_scales=perm["marlin_moe_permute_scales"],
        uint4b8=_scalar_types().uint4b8,
        import_s=time.time() - t0,
    )


# =========================================================================== bundle for a GPU host


BUNDLE_VARIANTS = [
    # (module, function, args) -- the variants fused_marlin_moe and this benchmark reach on sm_90.
    (
        "sglang.kernels.ops.moe.moe_wna16_marlin",
        "_jit_moe_wna16_marlin_module",
        ("bf16", False, False, True, False, True),
    ),
    (
        "sglang.kernels.ops.moe.moe_wna16_marlin",
        "_jit_moe_wna16_marlin_module",
        ("bf16", False, False, True, True, True),
    ),
    ("sglang.kernels.ops.moe.moe_align", "_jit_moe_align_module", ("int32", True, False, False)),
    ("sglang.kernels.ops.moe.moe_align_single_token", "_jit_align_single_token_module", (True,)),
    ("sglang.kernels.ops.quantization.gptq_marlin_repack", "_jit_gptq_marlin_repack_module", ()),
]


_SLIM_EXCLUDE = ("multimodal_gen", "test", "benchmark")


_BUNDLE_PREFIX = {
    "sglang.kernels.ops.moe.moe_wna16_marlin": "moe_wna16_marlin",
    "sglang.kernels.ops.moe.moe_align": "moe_align_block_size",
    "sglang.kernels.ops.moe.moe_align_single_token": "moe_align_single_token",
    "sglang.kernels.ops.quantization.gptq_marlin_repack": "gptq_marlin_repack",
}


def _bundle_so_name(module: str, args: tuple) -> str:
    """File name load_jit gives a variant (the single-token kernel also keys on PDL, on for sm_90)."""
    cpp = {"bf16": "bf16_t", "int32": "int32_t"}
    parts = [cpp.get(a, a) if isinstance(a, str) else str(a).lower() for a in args]
    if module.endswith("moe_align_single_token"):
        parts = ["true"] + parts
    return "sgl_kernel_jit_" + "_".join([_BUNDLE_PREFIX[module]] + parts) + ".so"


def make_bundle(out: Path, arch=(9, 0), jobs: int | None = None) -> None:
    """Compile the JIT kernels for ``arch`` here (nvcc; no GPU needed) and pack a trimmed copy
    of the installed SGLang Python package, for a GPU host that has neither."""
    import concurrent.futures as cf

    out.mkdir(parents=True, exist_ok=True)
    (out / "jit").mkdir(exist_ok=True)
    cache = out / "jit-cache"
    env = dict(os.environ, SGLANG_JIT_CACHE_DIR=str(cache))
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    code = (
        "import importlib, sys, torch\n"
        "from sglang.kernels.jit.utils import arch\n"
        "from sglang.kernels.jit.utils.compile import loader\n"
        "loader._load = lambda lib: None\n"
        "mod, fn, args = sys.argv[1], sys.argv[2], eval(sys.argv[3])\n"
        "args = tuple(getattr(torch, 'bfloat16' if a == 'bf16' else 'int32') if isinstance(a, str) else a for a in args)\n"
        f"with arch.override_jit_cuda_arch({arch[0]}, {arch[1]}):\n"
        "    getattr(importlib.import_module(mod), fn)(*args)\n"
    )
    t0 = time.time()
    have = {p.name for p in (out / "jit").glob("*.so")}
    todo = [(m, f, a) for m, f, a in BUNDLE_VARIANTS if _bundle_so_name(m, a) not in have]
    with cf.ThreadPoolExecutor(jobs or max(1, len(todo))) as pool:
        futs = [
            pool.submit(
                subprocess.run,
                [sys.executable, "-c", code, m, f, repr(a)],
                env=env,
                capture_output=True,
                text=True,
            )
            for m, f, a in todo
        ]
        for (_m, f, a), fu in zip(todo, futs):
            res = fu.result()
            status = "ok" if res.returncode == 0 else "FAILED:\n" + res.stderr[-3000:]
            print(f"[bundle] {f}{a}: {status}", flush=True)
    for so in cache.rglob("*.so"):
        shutil.copy2(so, out / "jit" / so.name)
    print(
        f"[bundle] compiled in {time.time() - t0:.0f} s: {sorted(p.name for p in (out / 'jit').glob('*.so'))}"
    )

    sg_dir = Path(list(importlib.util.find_spec("sglang").submodule_search_locations)[0])
    sk = importlib.util.find_spec("sgl_kernel")

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if len(parts) > 1 and parts[0] == "sglang" and parts[1] in _SLIM_EXCLUDE:
            return None
        if info.name.endswith((".so", ".pyc")) or "__pycache__" in parts:
            return None
        return info

    with tarfile.open(out / "site.tar.gz", "w:gz") as tar:
        tar.add(sg_dir, arcname="sglang", filter=keep)
        if sk is not None:
            sk_dir = Path(list(sk.submodule_search_locations)[0])
            tar.add(sk_dir / "scalar_type.py", arcname="sgl_kernel/scalar_type.py")
            info = tarfile.TarInfo("sgl_kernel/__init__.py")
            info.size = 0
            tar.addfile(info)  # the pure-Python part only: no compiled ops to load
    print(f"[bundle] {out / 'site.tar.gz'}: {(out / 'site.tar.gz').stat().st_size / 1e6:.1f} MB")
