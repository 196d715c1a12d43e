from phoenix_launch.cli import main

main()
