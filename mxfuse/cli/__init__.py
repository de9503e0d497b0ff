"""What the `mxfuse` command runs, one module per subcommand (`demo`, `explain`, `dump`), each with
`run(args, out)`. The parser and the argument checks are the `mxfuse_cli` package beside
`mxfuse`, which imports a module here only once the arguments are good."""
