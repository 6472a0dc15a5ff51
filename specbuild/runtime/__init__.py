"""Bundle in, tokens out. Never imports specbuild.build."""
