"""Tests of the sampler boundary: client, embedded server, conformance suite."""
