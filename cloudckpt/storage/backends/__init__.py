"""The built-in backends, one module or package each, independent of one another
(an import-linter contract): what a backend must provide, may provide and may reuse
is in this folder's README.md."""
