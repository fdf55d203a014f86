from tokenfleet.cli import main

main()
