from capyctl.entrypoints.cli.app import main

main()
