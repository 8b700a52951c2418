"""The commands: ``strata-generate`` (`strata_jax.cli.generate`) and ``strata-serve`` (`strata_jax.cli.serve`), their
shared flags (`strata_jax.cli.flags`), request handling (`strata_jax.cli.requests`) and the OpenAI-compatible HTTP
server (`strata_jax.cli.openai_api`, `strata_jax.cli.server`). Clients of `strata_jax.pipeline`."""
