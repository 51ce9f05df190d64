"""Reading compiled programs: HLO text, device models, cost, explain()'s report."""
