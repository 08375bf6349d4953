"""A recipe: our keys (`TaskArguments`, with each task plugin's), parsing a YAML file and the command line into them
and TRL's configs, and the grouped `--help`. May import plugins only.
"""
