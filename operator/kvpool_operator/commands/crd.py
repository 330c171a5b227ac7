"""``kvpool crd``: print or write the KVCachePool CRD generated from the models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "Print the KVCachePool CustomResourceDefinition (generated from the pydantic models)."

REFERENCE = Path("docs/kvcachepool-reference.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", "-o", type=Path, help="write the CRD to this file instead of stdout"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --output: exit 1 when the file differs from the generated CRD",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help=f"print (or with --output write) the field reference instead ({REFERENCE})",
    )


def run(args: argparse.Namespace) -> int:
    from kvpool_operator.crd import crd_yaml
    from kvpool_operator.reference_doc import reference_markdown

    text = reference_markdown() if args.reference else crd_yaml()
    out: Path | None = args.output
    if out is None:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = out.read_text() if out.exists() else ""
        if current != text:
            flag = " --reference" if args.reference else ""
            print(f"{out} is stale: run `kvpool crd{flag} --output {out}`", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0
