"""Generated from protos/splitspec/v1/*.proto by scripts/gen_protos.py; do not edit the stubs."""
