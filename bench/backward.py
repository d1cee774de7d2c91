"""Benchmark family 'backward' (see `dsattn bench --help`):  python bench/backward.py [--smoke] [--no-record]"""
import sys

from dsattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--family", "backward", *sys.argv[1:]]))
