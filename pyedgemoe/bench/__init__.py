"""Benchmarks: pyedgemoe vs stock llama.cpp, each measurement in its own (optionally capped) process.

    from pyedgemoe.bench import run_benchmark, format_report
    print(format_report(run_benchmark("model.gguf", prompt_tokens=16, output_tokens=32)))

See docs/benchmarks.md for what is measured and how.
"""

__all__ = ["BenchmarkError", "format_report", "prompt_token_ids", "run_benchmark"]


def __getattr__(name: str):
    # Imported on first use, not here: `python -m pyedgemoe.bench.worker` would otherwise find
    # its own module already imported by the package and runpy warns about it.
    if name in ("BenchmarkError", "format_report", "run_benchmark"):
        from pyedgemoe.bench import runner
        return getattr(runner, name)
    if name == "prompt_token_ids":
        from pyedgemoe.bench import worker
        return worker.prompt_token_ids
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
