"""A structured fuzzer of pyedgemoe's parsers, through its real command line (docs/reliability.md).

    seeds.py      small valid inputs built from the tests' tiny Mixtral, and the commands that read them
    gguf_file.py  a GGUF as a structure that can be damaged field by field
    mutations.py  a mutation recipe applied to an input's bytes (deterministic)
    generate.py   recipes chosen at random, per parser
    runner.py     one input through `pyedgemoe inspect|run|convert` in a subprocess, classified
    campaign.py   many inputs for a while, counted per parser, findings kept
    corpus.py     tests/fuzz_corpus/, the recipes that found something

    python -m fuzz campaign --minutes 30     # findings under build/fuzz/campaign-0/
    python -m fuzz replay                    # tests/fuzz_corpus/ again
"""
