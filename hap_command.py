"""The `hap` command's entry point, kept outside the hap package.

Importing hap loads torch, about two seconds. A Ctrl-C in those seconds would end the command
in a traceback of the import. Here it ends as a Ctrl-C does later (hap.cli.main): one line,
exit status 130.
"""

import sys


def interrupted() -> int:
    """How the command ends on a Ctrl-C, whenever it comes: one line, exit status 130 (the
    shell's for SIGINT). hap.cli and the hap package's import (`python -m hap`) end so too."""
    print("hap: interrupted", file=sys.stderr)
    return 130


def main() -> int:
    try:
        from hap.cli import main as hap_main
    except KeyboardInterrupt:
        return interrupted()
    return hap_main()


if __name__ == "__main__":
    sys.exit(main())
