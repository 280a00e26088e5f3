from benchmarks.fleet.bench import main

main()
