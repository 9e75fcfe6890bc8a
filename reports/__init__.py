"""python -m reports: results.json files into the README table, CSV, plots and plan figures (reads only results.json
and plan.json)."""
