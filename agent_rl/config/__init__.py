"""The whole run's config: every section gathered (`train`) and its YAML files (`file`).

Its sections live where their floors can read them: the shared ones and `ConfigError` on the ground floor
(`core.config`), the `algorithm` section beside the tables its choices name (`learn.algorithm`). What gathers
them stands above both, on the commands' floor."""
