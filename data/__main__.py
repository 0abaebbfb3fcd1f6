"""``python -m data``: fetch the UCI file and split tables into per-party files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.uci import BANK_MARKETING_URL, CACHE_HELP, locate_bank_full
from parties.cli import command, configure_logging, description, run_cli
from parties.errors import ConfigError


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            raise ConfigError(f"{flag} takes NAME=VALUE, got {v!r}")
        out[name] = rest
    return out




def build_parser(prog: str = "python -m data") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = command(sub, "fetch", "put a verified bank-full.csv into the data cache", handler=_fetch_command)
    fetch.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    fetch.add_argument("--url", default=BANK_MARKETING_URL, help="the UCI archive (default %(default)s)")

    bm = command(sub, "bank-marketing", "write the walkthrough's per-party files", handler=_bank_marketing_command)
    bm.add_argument("--out", type=Path, required=True, help="folder for OUT/<party>/<party>.csv")
    bm.add_argument("--partners", type=int, default=1, help="spread the partner columns over N partners (default %(default)s)")
    bm.add_argument("--partner-names", default=None, help="comma-separated names, one per partner")
    bm.add_argument("--seed", type=int, default=0, help="seed of who holds which customer (default %(default)s)")
    bm.add_argument("--rows", type=int, default=None, help="keep a seeded random slice of N customers")
    bm.add_argument("--bank-coverage", type=float, default=0.95,
                    help="share of the customers the bank holds (default %(default)s)")
    bm.add_argument("--partner-coverage", type=float, default=0.90,
                    help="share of the customers each partner holds (default %(default)s)")
    bm.add_argument("--cache-dir", type=Path, default=None,
                    help=CACHE_HELP)
    bm.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
    bm.add_argument("--no-download", action="store_true", help="fail instead of downloading")

    for name, summary, handler in (
        ("bank-owner", "write the U-shaped and vanilla walkthroughs' file: the bank owns every column and the label",
         _owner_command),
        ("bank-branches", "write the horizontal walkthroughs' files: the bank's customers split across branches by "
         "job (seeded, non-IID), every column at each branch, the labels at the bank", _branches_command),
    ):
        c = command(sub, name, summary, handler=handler)
        if name == "bank-branches":
            c.add_argument("--out", type=Path, required=True, help="folder for OUT/<branch>/<branch>.csv, the "
                           "bank's OUT/bank/labels.csv and OUT/branches.json (which jobs each branch holds)")
            c.add_argument("--branches", type=int, default=3, help="how many branches (default %(default)s)")
        else:
            c.add_argument("--out", type=Path, required=True, help="folder for OUT/bank/bank.csv")
        c.add_argument("--seed", type=int, default=0,
                       help="seed of the slice" + (" and of which branch each job goes to" if name == "bank-branches"
                                                   else "") + " (default %(default)s)")
        c.add_argument("--rows", type=int, default=None, help="keep a seeded random slice of N customers")
        c.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
        c.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
        c.add_argument("--no-download", action="store_true", help="fail instead of downloading")

    gen = command(sub, "partition", "split any CSV vertically", handler=_partition_command)
    gen.add_argument("--csv", type=Path, required=True, help="the whole table, one row per customer")
    gen.add_argument("--out", type=Path, required=True, help="folder for OUT/<party>/<party>.csv")
    gen.add_argument("--sep", default=None, help="field separator (default: ';' or ',' from the header)")
    gen.add_argument("--label", required=True, help="label column")
    gen.add_argument("--label-party", required=True, help="the party that keeps the label")
    gen.add_argument("--party", action="append", default=[], metavar="NAME=COL,COL", help="repeat per party")
    gen.add_argument("--coverage", action="append", default=[], metavar="NAME=FRACTION",
                     help="share of the customers a party holds (default 1); repeat per party")
    gen.add_argument("--id-column", default=None,
                     help="the customer ID column, kept in every party's file (default: synthesise stable IDs "
                          "from the row number, as customer_id)")
    gen.add_argument("--categorical", default=None, metavar="COL,COL",
                     help="columns to treat as categorical whatever they look like, e.g. integer codes")
    gen.add_argument("--numeric", default=None, metavar="COL,COL", help="columns to treat as numeric")
    gen.add_argument("--seed", type=int, default=0, help="seed of who holds which customer (default %(default)s)")
    gen.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")

    sch = command(sub, "schema", "show a table's schema (inferred, or its schema file) and write one to edit",
                  handler=_schema_command)
    sch.add_argument("file", type=Path, help="a party's CSV, Parquet or Feather file")
    sch.add_argument("--id-column", default=None, help="the customer ID column (default: the schema file's, else customer_id)")
    sch.add_argument("--label", default=None,
                     help="the label column, for the bank's table (default: the schema file's, else none)")
    sch.add_argument("--id-type", choices=["integer", "text"], default=None,
                     help="integer: 12, 12.0 and 0012 are one customer; text: IDs as written (default: the schema "
                          "file's, else integer if every ID is a whole number)")
    sch.add_argument("--task", choices=["binary", "multiclass", "regression"], default=None,
                     help="with a label: what it is (default: the schema file's, else inferred from its values)")
    sch.add_argument("--categorical", default=None, metavar="COL,COL",
                     help="columns to treat as categorical whatever they look like, e.g. integer codes")
    sch.add_argument("--numeric", default=None, metavar="COL,COL", help="columns to treat as numeric")
    sch.add_argument("--write", action="store_true",
                     help="write it to FILE.schema.json (refuses to replace one that exists, unless --force)")
    sch.add_argument("--force", action="store_true", help="with --write: replace an existing schema file")
    sch.set_defaults(log_level="WARNING")
    return parser


def _list(text: str | None) -> tuple[str, ...]:
    return tuple(c.strip() for c in (text or "").split(",") if c.strip())


# The handlers import pandas when they run: --help does not need it.


def _schema_command(args: argparse.Namespace) -> int:
    from parties.tables.schema import PartySchema, read_schema, sidecar_path
    from parties.tables.table import load_party_table

    target = sidecar_path(args.file)
    existing = read_schema(target)
    label = args.label or (existing.label_column if existing else None)  # the schema file's label, unless told
    table = load_party_table(args.file, args.id_column, label, labelled=label is not None,
                             categorical=_list(args.categorical), numeric=_list(args.numeric), id_type=args.id_type,
                             task=args.task)
    schema = PartySchema(id_column=table.id_column, id_type=table.id_type, label_column=label, task=table.task,
                         numeric=table.schema.numeric, categorical=table.schema.categorical)
    print(schema.model_dump_json(indent=2))
    if len(table.id_formats) > 1:
        print(f"note: column {table.id_column!r} writes its IDs in {len(table.id_formats)} ways ("
              + ", ".join(f"{n} {f}" for f, n in table.id_formats.items()) + f"); they are read as {table.id_type} IDs",
              file=sys.stderr)
    if args.write:
        if target.exists() and not args.force:
            raise ConfigError(f"{target} exists; edit it, or pass --force to replace it")
        schema.write(target)
        print(f"written to {target}: edit it, then every command that reads {args.file.name} follows it",
              file=sys.stderr)
    return 0


def _fetch_command(args: argparse.Namespace) -> int:
    print(locate_bank_full(args.cache_dir, url=args.url))
    return 0


def _bank_marketing_command(args: argparse.Namespace) -> int:
    from data.prepare import prepare_bank_marketing

    names = args.partner_names.split(",") if args.partner_names else None
    paths = prepare_bank_marketing(
        args.out,
        n_partners=args.partners,
        partner_names=names,
        seed=args.seed,
        rows=args.rows,
        bank_coverage=args.bank_coverage,
        partner_coverage=args.partner_coverage,
        cache=args.cache_dir,
        download=not args.no_download,
    )
    _print_paths(paths)
    return 0


def _owner_command(args: argparse.Namespace) -> int:
    from data.configurations import prepare_owner

    _print_paths(prepare_owner(args.out, rows=args.rows, seed=args.seed, cache=args.cache_dir,
                               download=not args.no_download))
    return 0


def _branches_command(args: argparse.Namespace) -> int:
    from data.configurations import prepare_branches

    _print_paths(prepare_branches(args.out, branches=args.branches, rows=args.rows, seed=args.seed,
                                  cache=args.cache_dir, download=not args.no_download))
    print(f"which jobs each branch holds, its customers and subscription rate: {args.out / 'branches.json'}")
    return 0


def _partition_command(args: argparse.Namespace) -> int:
    from data.partition import PartitionSpec, PartySpec, partition, read_source_csv, write_partition

    if not args.party:
        raise ConfigError("give at least one --party NAME=COL,COL")
    coverage = {k: float(v) for k, v in _pairs(args.coverage, "--coverage").items()}
    parties = _pairs(args.party, "--party")
    unknown = set(coverage) - set(parties)
    if unknown:
        raise ConfigError(f"--coverage names unknown parties: {sorted(unknown)}")
    spec = PartitionSpec(
        parties=tuple(PartySpec(n, tuple(c.split(",")), coverage.get(n, 1.0)) for n, c in parties.items()),
        label_column=args.label,
        label_party=args.label_party,
        id_column=args.id_column,
        seed=args.seed,
        categorical=_list(args.categorical),
        numeric=_list(args.numeric),
    )
    frame = read_source_csv(args.csv, args.sep)
    _print_paths(write_partition(partition(frame, spec, str(args.csv)), spec, args.out))
    return 0


def _print_paths(paths: dict[str, Path]) -> None:
    for name, path in paths.items():
        print(f"{name}: {path}")


def main(argv: list[str] | None = None, prog: str = "python -m data") -> int:
    args = build_parser(prog).parse_args(argv)
    configure_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    return args.handler(args)


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
