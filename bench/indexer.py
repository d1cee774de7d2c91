"""Benchmark family 'indexer' (see `dsattn bench --help`):  python bench/indexer.py [--smoke] [--no-record]"""
import sys

from dsattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--family", "indexer", *sys.argv[1:]]))
