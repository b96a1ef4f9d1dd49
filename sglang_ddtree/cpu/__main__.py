"""Manage the CPU serving mode's start-up hook.

python -m sglang_ddtree.cpu install-hook    # write sglang_ddtree_cpu.pth
python -m sglang_ddtree.cpu remove-hook
python -m sglang_ddtree.cpu status
"""

from __future__ import annotations

import sys

from .hook import hook_path, install_hook, remove_hook


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    if command == "install-hook":
        print(f"installed {install_hook()}")
    elif command == "remove-hook":
        print("removed" if remove_hook() else "no hook was installed")
    elif command == "status":
        path = hook_path()
        print(f"{path}: {'installed' if path.exists() else 'not installed'}")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
