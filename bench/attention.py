"""Benchmark family 'attention' (see `dsattn bench --help`):  python bench/attention.py [--smoke] [--no-record]"""
import sys

from dsattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--family", "attention", *sys.argv[1:]]))
