"""The `fmoe` command line: `fmoe.cli.main.main` parses argv; each sub-command is a module here."""
