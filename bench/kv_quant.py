"""Benchmark family 'kv_quant' (see `dsattn bench --help`):  python bench/kv_quant.py [--smoke] [--no-record]"""
import sys

from dsattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--family", "kv_quant", *sys.argv[1:]]))
