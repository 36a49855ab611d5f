"""Integrations of weightcache with model libraries: ``weightcache.integrations.transformers``
(docs/python.md). Each imports its library only when used."""
