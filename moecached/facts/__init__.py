"""Shared facts with no behaviour: units, file identity, the GGUF layout format, the protocol's
ops and error codes, the counters. Every other wing imports these; they import none of them."""
