from specbuild.cli import main

main()
