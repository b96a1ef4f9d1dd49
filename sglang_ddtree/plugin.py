"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``ddtree``).

SGLang calls :func:`register` through ``load_plugins()`` in the launcher, before
it parses arguments, and again in every scheduler process. Everything here is
idempotent.
"""

from __future__ import annotations

import logging
import sys

from .config import SETTINGS_ATTR, DDTreeConfigError, cpu_engine_requested, settings_of, test_plugin_modules

logger = logging.getLogger("sglang_ddtree")

_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    if cpu_engine_requested():
        from .cpu import fallbacks

        fallbacks.install()
    from .adapter.spec import register_algorithm

    register_algorithm()
    from .adapter.attention import torch_native

    torch_native.install()
    from .adapter.attention import gpu_backends

    gpu_backends.install()
    from .adapter import plain_steps, req_to_token, requests, reservation, stops

    requests.install()
    stops.install()
    req_to_token.install()
    plain_steps.install()
    reservation.install()
    _install_cli_hooks()
    _install_error_reporting()
    _install_test_plugin()


def _install_test_plugin() -> None:
    import importlib

    for name in test_plugin_modules():
        importlib.import_module(name).install()


def _install_cli_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .adapter import server_args, server_info
    from .adapter.spec import ALGORITHM_NAME

    def add_cli_args(original, *args, **kwargs):
        result = original(*args, **kwargs)
        parser = args[-1] if args else kwargs["parser"]
        server_args.add_cli_args(parser)
        return result

    def from_cli_args(original, *args, **kwargs):
        namespace = args[-1] if args else kwargs["args"]
        server_args.check_cli_namespace(namespace)
        result = original(*args, **kwargs)
        # The settings travel to every scheduler process on the record itself.
        setattr(result, SETTINGS_ATTR, server_args.settings_from_flags(namespace))
        return result

    def resolve_algorithm_alias(original, algorithm, draft_path, *args, **kwargs):
        # SGLang reads the drafter's config here, before any validator runs; a
        # wrong path would surface as a hub-lookup traceback.
        if algorithm is not None and str(algorithm).upper() == ALGORITHM_NAME:
            server_args.read_drafter_config(draft_path)
        return original(algorithm, draft_path, *args, **kwargs)

    def with_ddtree_section(result, server_args_obj, *args, **kwargs):
        algorithm = str(getattr(server_args_obj, "speculative_algorithm", None) or "").upper()
        if algorithm == ALGORITHM_NAME and isinstance(result, dict):
            # Without a budget flag the launcher's arguments keep the width unset (the
            # scheduler's copy is resolved): resolve it the same way here.
            result["ddtree"] = server_info.server_info_section(
                server_args.resolve_config(server_args_obj).verify_width,
                settings_of(server_args_obj),
                cuda_graphs=server_args.serves_cuda_graphs(server_args_obj),
            )
        return result

    import multiprocessing

    if multiprocessing.parent_process() is None:  # the HTTP server lives in the launcher only
        HookRegistry.register(
            "sglang.srt.entrypoints.http_server.build_server_info", with_ddtree_section, HookType.AFTER
        )
    target = "sglang.srt.server_args.ServerArgs"
    HookRegistry.register(f"{target}.add_cli_args", add_cli_args, HookType.AROUND)
    HookRegistry.register(f"{target}.from_cli_args", from_cli_args, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias",
        resolve_algorithm_alias,
        HookType.AROUND,
    )


def _install_error_reporting() -> None:
    """In a launcher, show configuration errors as one line, not a traceback."""
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if isinstance(exc, DDTreeConfigError):
            sys.stderr.write(f"error: {exc}\n")
            sys.stderr.flush()
            return
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
