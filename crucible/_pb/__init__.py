"""Generated from proto/crucible.proto; do not edit."""
