"""Pipeline plug-ins: filters, scorers and pickers, each referred to by its llm-d-style type name."""
