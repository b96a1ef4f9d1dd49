# Installed as ``sglang_ddtree.cuda`` (the kernel sources). When the repository root is on
# sys.path (tests, ``python -m`` from a checkout) this folder is also importable as the
# top-level ``cuda``, which would hide NVIDIA's ``cuda`` namespace package (cuda.bindings,
# cuda.pathfinder - CuPy imports them): extend the search path to those portions.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)
