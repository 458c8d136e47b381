"""`python -m toma sizes [--file PATH] [--clear]`: list, or forget, the sizes kept across runs."""

import argparse
import datetime
import os
import sys
from typing import List, Optional

from toma.core.size_file import ENVIRONMENT_VARIABLE, SizeStore
from toma.sizing.learned import describe_remembered


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toma", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    sizes = commands.add_parser("sizes", help="the sizes toma remembers across runs")
    sizes.add_argument("--file", default=os.environ.get(ENVIRONMENT_VARIABLE), help=f"default: ${ENVIRONMENT_VARIABLE}")
    sizes.add_argument("--clear", action="store_true", help="forget every remembered size")
    options = parser.parse_args(argv)
    if not options.file:
        parser.error(f"no size file: pass --file PATH or set {ENVIRONMENT_VARIABLE}")
    if not os.path.isfile(options.file):
        print(f"{options.file}: no such file", file=sys.stderr)
        return 1
    store = SizeStore(options.file)
    try:
        if options.clear:
            print(f"forgot {store.clear()} sizes in {options.file}")
            return 0
        rows = store.rows()
    except Exception as error:  # noqa: BLE001 - a corrupt or foreign file: say so, as a CLI does
        print(f"{options.file}: {error}", file=sys.stderr)
        return 1
    if not rows:
        print(f"{options.file}: no sizes remembered")
    for site, device, size, model, updated in rows:
        when = datetime.datetime.fromtimestamp(updated).isoformat(timespec="seconds")
        print(f"{size:>8}  {site}  [{device}]  {describe_remembered(model)}  {when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
