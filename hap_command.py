"""The `hap` command's entry point, kept outside the hap package.

Importing hap loads torch, about two seconds. A Ctrl-C in those seconds would end the command
in a traceback of the import. Here it ends as a Ctrl-C does later (hap.cli.main): one line,
exit status 130.
"""

import sys


def interrupted() -> int:
    """How the command ends on a Ctrl-C, whenever it comes: one line, exit status 130 (the
    shell's for SIGINT). hap.cli and the hap package's import (`python -m hap`) end so too.
    Under `python -m hap`, where the Ctrl-C landed in code run by exec() (dataclasses and
    torch.fx make functions so, while torch loads and while a model is captured), CPython's exit
    kills the process by SIGINT instead, whatever status was asked for (it records the interrupt
    as unhandled, though it was handled; seen with a package of three lines): a parent process
    sees -2, a shell 130 as for the status."""
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
