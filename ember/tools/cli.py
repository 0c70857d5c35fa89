"""`ember` command line: `ember demo`, `ember bench`, `ember fuzz`, `ember bisect`, `ember config`,
`ember cache path|clear|export FILE|import FILE`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo", help="compile models, check against eager, print speed-ups (ember demo --help)", add_help=False
    )
    sub.add_parser(
        "bench", help="eager vs Inductor vs ember against the measured limit (ember bench --help)", add_help=False
    )
    sub.add_parser("fuzz", help="random programs checked against eager (ember fuzz --help)", add_help=False)
    sub.add_parser(
        "bisect", help="find the op that makes a result differ from eager (ember bisect --help)", add_help=False
    )
    sub.add_parser(
        "explain",
        help="every layer of what ember did to a script's function, timed (ember explain --help)",
        add_help=False,
    )
    sub.add_parser(
        "profile", help="where a model's step spends its time, and a verdict (ember profile --help)", add_help=False
    )
    sub.add_parser(
        "ladder", help="matmul and layer norm + GELU from Python loops to ember (ember ladder --help)", add_help=False
    )
    sub.add_parser("opinfo", help="ember vs eager on PyTorch's OpInfo database (ember opinfo --help)", add_help=False)
    sub.add_parser("config", help="list every setting with its current value")
    cache = sub.add_parser(
        "cache",
        help="show or empty the disk cache (ember cache --help)",
        description="ember's disk cache of compiled graphs (setting cache_dir, env EMBER_CACHE_DIR).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="actions:\n"
        "  path         print the folder the disk cache lives in\n"
        "  clear        delete ember's entries in it; a folder without the marker ember writes when it\n"
        "               creates a cache (CACHEDIR.TAG) is left untouched, and so is anything not ember's\n"
        "  export FILE  write every entry to one file (checksummed), for another machine of the same kind\n"
        "  import FILE  check such a file and add its entries; a damaged file, or one made for another\n"
        "               GPU, torch, Triton or ember, is refused and nothing is imported",
    )
    cache.add_argument("action", choices=["path", "clear", "export", "import"], help="see below")
    cache.add_argument("file", nargs="?", help="export/import: the cache file")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from ember.tools.demo import main as demo

        return demo(rest)
    if args.command == "bench":
        from ember.tools.bench.__main__ import main as bench

        return bench(rest)
    if args.command == "explain":
        from ember.tools.explain_cli import main as explain

        return explain(rest)
    if args.command == "profile":
        from ember.tools.profile_step import main as profile

        return profile(rest)
    if args.command == "ladder":
        from ember.tools.ladder import main as ladder

        return ladder(rest)
    if args.command == "opinfo":
        from ember.tools.opinfo import main as opinfo

        return opinfo(rest)
    if args.command == "fuzz":
        from ember.tools.fuzz import main as fuzz

        return fuzz(rest)
    if args.command == "bisect":
        from ember.tools.bisect import main as bisect

        return bisect(rest)
    from ember import config

    if args.command == "config":
        print(config.describe())
    elif args.action == "path":
        print(config.get("cache_dir"))
    elif args.action in ("export", "import"):
        return _move_cache(args.action, args.file)
    else:
        return _clear_cache()
    return 0


def _move_cache(action: str, path: str | None) -> int:
    from ember import config
    from ember.frontend.cache_file import load_cache, save_cache
    from ember.runtime.portable import CacheFileError

    if not path:
        print(f"ember cache {action}: name the file (ember cache {action} FILE)", file=sys.stderr)
        return 2
    try:
        done = save_cache(path) if action == "export" else load_cache(path)
    except (CacheFileError, OSError) as e:
        print(f"ember cache {action}: {e}", file=sys.stderr)
        return 1
    where = f"to {path}" if action == "export" else f"from {path} into {config.get('cache_dir')}"
    print(f"{action}ed {done.entries} entries ({done.files} files, {done.bytes / 1e6:.1f} MB) {where}")
    return 0


def _clear_cache() -> int:
    from ember.runtime.cache import DiskCache, NotEmberCache

    cache = DiskCache()
    try:
        removed = cache.clear()
    except FileNotFoundError:
        print(f"{cache.root}: no cache there, nothing to clear")
        return 0
    except (NotEmberCache, OSError) as e:
        print(f"ember cache clear: {e}", file=sys.stderr)
        return 1
    print(f"cleared {cache.root}" + (f" (removed {', '.join(removed)})" if removed else " (it was empty)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
