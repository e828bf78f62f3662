"""The SQL example's domains: small relational schemas (tables, columns, foreign keys) the databases are built from.

A :class:`Domain` is a few :class:`Table` s; each table has an ``id`` primary key and :class:`Column` s of four
kinds: ``label`` (a unique text: a person's name, a title), ``cat`` (a text from a small pool: a genre, a city),
``num`` (an integer in a range) and ``fk`` (the ``id`` of a row of an earlier table). Each table and column carries
the words the question templates write with (``singular``, ``phrase``), so the templates
(:mod:`examples.sql_agent.questions`) work on any domain. ``TRAIN_DOMAINS`` give the training questions and the
in-distribution held-out questions; ``UNSEEN_DOMAINS`` only the unseen held-out split, so its schemas are never
seen in training.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DOMAINS", "TRAIN_DOMAINS", "UNSEEN_DOMAINS", "Column", "Domain", "Table"]

FIRST = (
    "Ada",
    "Bram",
    "Cleo",
    "Dov",
    "Elin",
    "Finn",
    "Gala",
    "Hugo",
    "Iris",
    "Jon",
    "Kira",
    "Liam",
    "Mira",
    "Nils",
    "Olga",
    "Pavel",
)
LAST = ("Ashby", "Brook", "Crane", "Dale", "Ember", "Frost", "Grove", "Hale", "Irwin", "Jory", "Knox", "Lund")
CITIES = ("Arden", "Belmoor", "Corvel", "Dunmere", "Eskar", "Falloway", "Glenrock", "Harrow")
COUNTRIES = ("Norland", "Ostria", "Pellia", "Quarn", "Rosmark", "Sundale")
ADJECTIVES = ("Silent", "Golden", "Broken", "Hidden", "Quiet", "Burning", "Frozen", "Distant", "Gentle", "Wild")
NOUNS = ("River", "Garden", "Tower", "Harbor", "Forest", "Mirror", "Bridge", "Valley", "Lantern", "Island")


@dataclass(frozen=True)
class Column:
    """One column: ``kind`` is ``label``, ``cat``, ``num`` or ``fk``; ``phrase`` is how a question names it."""

    name: str
    kind: str
    phrase: str
    pool: tuple[str, ...] = ()  # cat: the values; label: the first words
    second: tuple[str, ...] = ()  # label: the second words (a label is "first second")
    low: int = 0
    high: int = 0
    additive: bool = False  # num: a total of it means something (quantities, not years)
    ref: str = ""  # fk: the table it points to


@dataclass(frozen=True)
class Table:
    """One table: its name (plural), the singular noun for it, its row count and its columns (after ``id``)."""

    name: str
    singular: str
    rows: int
    columns: tuple[Column, ...]

    def of(self, kind: str) -> list[Column]:
        return [c for c in self.columns if c.kind == kind]

    @property
    def label(self) -> Column | None:
        return next(iter(self.of("label")), None)


@dataclass(frozen=True)
class Domain:
    """A schema: tables in an order where each foreign key points to an earlier table."""

    name: str
    tables: tuple[Table, ...]

    def table(self, name: str) -> Table:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"the {self.name} domain has no table {name!r}")

    def links(self) -> list[tuple[Table, Column, Table]]:
        """Every foreign key: (child table, its fk column, parent table)."""
        return [(t, c, self.table(c.ref)) for t in self.tables for c in t.of("fk")]


def person(name: str = "name") -> Column:
    return Column(name, "label", name, FIRST, LAST)


def titled(name: str, first: tuple[str, ...] = ADJECTIVES, second: tuple[str, ...] = NOUNS) -> Column:
    return Column(name, "label", name, first, second)


def cat(name: str, pool: tuple[str, ...], phrase: str = "") -> Column:
    return Column(name, "cat", phrase or name, pool)


def num(name: str, low: int, high: int, phrase: str = "", additive: bool = False) -> Column:
    return Column(name, "num", phrase or name, low=low, high=high, additive=additive)


def fk(name: str, ref: str) -> Column:
    return Column(name, "fk", name.removesuffix("_id"), ref=ref)


def table(name: str, singular: str, rows: int, *columns: Column) -> Table:
    return Table(name, singular, rows, columns)


TRAIN_DOMAINS = (
    Domain(
        "school",
        (
            table(
                "teachers",
                "teacher",
                10,
                person(),
                cat("subject", ("math", "art", "music", "history")),
                num("salary", 30, 90, "salary in thousands"),
            ),
            table(
                "classes",
                "class",
                16,
                titled(
                    "title",
                    ("Morning", "Evening", "Weekend", "Advanced"),
                    ("Drawing", "Algebra", "Choir", "Debate", "Chess"),
                ),
                cat("room", ("A1", "A2", "B1", "B2")),
                num("size", 8, 30, "class size"),
                fk("teacher_id", "teachers"),
            ),
            table(
                "students",
                "student",
                40,
                person(),
                cat("city", CITIES[:5]),
                num("age", 11, 18),
                fk("class_id", "classes"),
            ),
        ),
    ),
    Domain(
        "library",
        (
            table("authors", "author", 10, person(), cat("country", COUNTRIES), num("born", 1930, 1995, "birth year")),
            table(
                "books",
                "book",
                30,
                titled("title"),
                cat("genre", ("poetry", "fantasy", "history", "crime")),
                num("pages", 80, 900, "page count"),
                fk("author_id", "authors"),
            ),
            table(
                "loans",
                "loan",
                60,
                fk("book_id", "books"),
                cat("branch", ("north", "south", "central")),
                num("days", 1, 60, "loan length in days", additive=True),
            ),
        ),
    ),
    Domain(
        "hospital",
        (
            table(
                "doctors",
                "doctor",
                10,
                person(),
                cat("specialty", ("cardiology", "surgery", "pediatrics", "oncology")),
                num("experience", 1, 35, "experience in years"),
            ),
            table(
                "patients",
                "patient",
                36,
                person(),
                cat("city", CITIES[2:]),
                num("age", 1, 95),
                fk("doctor_id", "doctors"),
            ),
            table(
                "visits",
                "visit",
                60,
                fk("patient_id", "patients"),
                cat("ward", ("east", "west", "north")),
                num("cost", 40, 900, additive=True),
            ),
        ),
    ),
    Domain(
        "airline",
        (
            table(
                "pilots",
                "pilot",
                10,
                person(),
                cat("rank", ("captain", "first officer", "trainee")),
                num("hours", 200, 9000, "flight time in hours"),
            ),
            table(
                "flights",
                "flight",
                40,
                titled("code", ("FA", "FB", "FC", "FD"), tuple(str(n) for n in range(100, 120))),
                cat("destination", CITIES),
                num("distance", 150, 4000, "distance in km"),
                num("passengers", 20, 300, "passenger count", additive=True),
                fk("pilot_id", "pilots"),
            ),
        ),
    ),
    Domain(
        "football",
        (
            table(
                "teams",
                "team",
                8,
                titled("name", ("Red", "Blue", "Iron", "Royal"), ("Lions", "Rovers", "United")),
                cat("city", CITIES),
                num("founded", 1880, 2010, "founding year"),
            ),
            table(
                "players",
                "player",
                44,
                person(),
                cat("position", ("goalkeeper", "defender", "midfielder", "forward")),
                num("goals", 0, 30, "goal count", additive=True),
                num("age", 17, 38),
                fk("team_id", "teams"),
            ),
        ),
    ),
    Domain(
        "cinema",
        (
            table("directors", "director", 10, person(), cat("country", COUNTRIES)),
            table(
                "movies",
                "movie",
                30,
                titled("title"),
                cat("genre", ("drama", "comedy", "horror", "western")),
                num("minutes", 80, 190, "running time in minutes"),
                num("year", 1960, 2024, "release year"),
                fk("director_id", "directors"),
            ),
            table(
                "screenings",
                "screening",
                50,
                fk("movie_id", "movies"),
                cat("hall", ("small", "large", "open air")),
                num("tickets", 5, 250, "ticket count", additive=True),
            ),
        ),
    ),
    Domain(
        "restaurant",
        (
            table(
                "chefs",
                "chef",
                8,
                person(),
                cat("cuisine", ("french", "thai", "italian", "mexican")),
                num("years", 1, 30, "experience in years"),
            ),
            table(
                "dishes",
                "dish",
                24,
                titled(
                    "name",
                    ("Spicy", "Sweet", "Green", "Smoked", "Crispy"),
                    ("Soup", "Curry", "Salad", "Noodles", "Tart"),
                ),
                cat("course", ("starter", "main", "dessert")),
                num("price", 4, 40),
                fk("chef_id", "chefs"),
            ),
            table(
                "orders",
                "order",
                60,
                fk("dish_id", "dishes"),
                cat("weekday", ("monday", "friday", "saturday")),
                num("quantity", 1, 8, additive=True),
            ),
        ),
    ),
    Domain(
        "garden_club",
        (
            table("members", "member", 12, person(), cat("town", CITIES[:4]), num("age", 19, 85)),
            table(
                "plots",
                "plot",
                20,
                titled("name", ("North", "South", "East", "West"), ("Bed", "Corner", "Terrace", "Patch", "Meadow")),
                cat("soil", ("clay", "sand", "loam")),
                num("area", 4, 60, "area in square meters", additive=True),
                fk("member_id", "members"),
            ),
            table(
                "plants",
                "plant",
                30,
                titled(
                    "name",
                    ("Blue", "White", "Dwarf", "Giant", "Early"),
                    ("Rose", "Tulip", "Fern", "Sage", "Lily", "Poppy"),
                ),
                cat("kind", ("flower", "herb", "shrub")),
                num("height", 5, 200, "height in cm"),
                fk("plot_id", "plots"),
            ),
        ),
    ),
    Domain(
        "museum",
        (
            table(
                "artists", "artist", 10, person(), cat("nationality", COUNTRIES), num("born", 1800, 1990, "birth year")
            ),
            table(
                "artworks",
                "artwork",
                30,
                titled("title"),
                cat("medium", ("oil", "bronze", "marble", "ink")),
                num("value", 5, 900, "value in thousands", additive=True),
                fk("artist_id", "artists"),
            ),
            table(
                "exhibitions",
                "exhibition",
                40,
                fk("artwork_id", "artworks"),
                cat("room", ("gallery", "atrium", "vault")),
                num("visitors", 100, 5000, "visitor count", additive=True),
            ),
        ),
    ),
    Domain(
        "hotel",
        (
            table(
                "hotels",
                "hotel",
                8,
                titled("name", ("Grand", "Park", "Harbor", "Alpine"), ("Inn", "Lodge", "Palace")),
                cat("city", CITIES),
                num("stars", 1, 5, "star rating"),
            ),
            table(
                "rooms",
                "room",
                40,
                fk("hotel_id", "hotels"),
                cat("kind", ("single", "double", "suite")),
                num("price", 40, 400, "nightly price"),
                num("floor", 1, 9, "floor number"),
            ),
            table(
                "stays",
                "stay",
                60,
                fk("room_id", "rooms"),
                cat("season", ("winter", "spring", "summer", "autumn")),
                num("nights", 1, 14, "stay length in nights", additive=True),
            ),
        ),
    ),
    Domain(
        "zoo",
        (
            table("keepers", "keeper", 8, person(), cat("shift", ("early", "late", "night")), num("salary", 25, 70)),
            table(
                "enclosures",
                "enclosure",
                12,
                titled("name", ("Sunny", "Misty", "Rocky", "Shady"), ("Hill", "Pond", "Grove")),
                cat("habitat", ("savanna", "jungle", "arctic", "desert")),
                num("area", 100, 5000, "area in square meters"),
                fk("keeper_id", "keepers"),
            ),
            table(
                "animals",
                "animal",
                40,
                person("name"),
                cat("species", ("lion", "zebra", "penguin", "camel")),
                num("age", 1, 30),
                num("weight", 1, 900, "weight in kg", additive=True),
                fk("enclosure_id", "enclosures"),
            ),
        ),
    ),
    Domain(
        "music",
        (
            table(
                "bands",
                "band",
                10,
                titled(
                    "name", ("Velvet", "Neon", "Electric", "Lunar", "Paper"), ("Wolves", "Tides", "Echoes", "Saints")
                ),
                cat("genre", ("rock", "jazz", "folk", "pop")),
                num("formed", 1965, 2020, "founding year"),
            ),
            table(
                "albums",
                "album",
                30,
                titled("title"),
                num("tracks", 6, 20, "track count", additive=True),
                num("year", 1970, 2024, "release year"),
                fk("band_id", "bands"),
            ),
            table(
                "concerts",
                "concert",
                50,
                fk("band_id", "bands"),
                cat("city", CITIES),
                num("tickets", 100, 20000, "ticket count", additive=True),
            ),
        ),
    ),
    Domain(
        "bakery",
        (
            table(
                "bakers",
                "baker",
                8,
                person(),
                cat("shift", ("dawn", "morning", "evening")),
                num("years", 1, 40, "service in years"),
            ),
            table(
                "breads",
                "bread",
                24,
                titled(
                    "name", ("Rustic", "Honey", "Seeded", "Dark", "Soft"), ("Loaf", "Roll", "Braid", "Bun", "Bagel")
                ),
                cat("flour", ("wheat", "rye", "spelt")),
                num("price", 1, 12),
                num("weight", 50, 1200, "weight in grams"),
                fk("baker_id", "bakers"),
            ),
            table(
                "sales",
                "sale",
                60,
                fk("bread_id", "breads"),
                cat("weekday", ("monday", "wednesday", "saturday")),
                num("quantity", 1, 30, additive=True),
            ),
        ),
    ),
    Domain(
        "gym",
        (
            table(
                "trainers",
                "trainer",
                8,
                person(),
                cat("specialty", ("yoga", "boxing", "strength", "cardio")),
                num("years", 1, 25, "experience in years"),
            ),
            table(
                "members",
                "member",
                36,
                person(),
                cat("city", CITIES[3:]),
                num("age", 16, 80),
                fk("trainer_id", "trainers"),
            ),
            table(
                "workouts",
                "workout",
                70,
                fk("member_id", "members"),
                cat("kind", ("run", "swim", "lift", "cycle")),
                num("minutes", 10, 120, "duration in minutes", additive=True),
            ),
        ),
    ),
)

UNSEEN_DOMAINS = (
    Domain(
        "shipping",
        (
            table("ports", "port", 8, titled("name", ("Port", "Bay of", "Cape"), CITIES), cat("country", COUNTRIES)),
            table(
                "ships",
                "ship",
                24,
                titled(
                    "name", ("Sea", "Storm", "Star", "Wave", "North"), ("Queen", "Runner", "Spirit", "Hawk", "Dancer")
                ),
                cat("type", ("tanker", "ferry", "cargo")),
                num("tonnage", 500, 90000),
                fk("port_id", "ports"),
            ),
            table(
                "voyages",
                "voyage",
                50,
                fk("ship_id", "ships"),
                cat("cargo", ("grain", "oil", "cars", "timber")),
                num("days", 2, 40, "duration in days", additive=True),
            ),
        ),
    ),
    Domain(
        "farm",
        (
            table(
                "farmers", "farmer", 8, person(), cat("region", ("highland", "lowland", "coast")), num("age", 22, 80)
            ),
            table(
                "fields",
                "field",
                24,
                titled(
                    "name", ("Upper", "Lower", "Long", "Stony", "Broad"), ("Acre", "Meadow", "Field", "Strip", "Close")
                ),
                cat("crop", ("wheat", "barley", "maize", "potato")),
                num("hectares", 1, 80, "area in hectares", additive=True),
                fk("farmer_id", "farmers"),
            ),
            table(
                "harvests",
                "harvest",
                60,
                fk("field_id", "fields"),
                num("tons", 1, 300, "yield in tons", additive=True),
                num("year", 2015, 2025, "harvest year"),
            ),
        ),
    ),
    Domain(
        "theatre",
        (
            table(
                "playwrights",
                "playwright",
                8,
                person(),
                cat("country", COUNTRIES),
                num("born", 1850, 1990, "birth year"),
            ),
            table(
                "plays",
                "play",
                20,
                titled("title"),
                cat("genre", ("tragedy", "comedy", "musical")),
                num("acts", 1, 5, "act count"),
                fk("playwright_id", "playwrights"),
            ),
            table(
                "performances",
                "performance",
                60,
                fk("play_id", "plays"),
                cat("venue", ("royal", "studio", "garden")),
                num("audience", 40, 900, "audience size", additive=True),
            ),
        ),
    ),
    Domain(
        "bike_rental",
        (
            table(
                "stations",
                "station",
                8,
                titled("name", ("Market", "Station", "Harbor", "College"), ("Square", "Street")),
                cat("district", ("old town", "docks", "uptown")),
                num("docks", 8, 40, "dock count"),
            ),
            table(
                "bikes",
                "bike",
                30,
                cat("model", ("city", "cargo", "electric")),
                num("age", 0, 9, "age in years"),
                fk("station_id", "stations"),
            ),
            table(
                "rides",
                "ride",
                70,
                fk("bike_id", "bikes"),
                cat("weekday", ("monday", "thursday", "sunday")),
                num("minutes", 3, 90, "duration in minutes", additive=True),
            ),
        ),
    ),
    Domain(
        "observatory",
        (
            table(
                "astronomers",
                "astronomer",
                8,
                person(),
                cat("field", ("planets", "stars", "galaxies")),
                num("papers", 1, 120, "paper count", additive=True),
            ),
            table(
                "telescopes",
                "telescope",
                12,
                titled("name", ("Great", "North", "Twin", "Deep"), ("Eye", "Dish", "Mirror")),
                cat("site", ("summit", "desert", "island")),
                num("mirror", 1, 40, "mirror size in meters"),
                fk("astronomer_id", "astronomers"),
            ),
            table(
                "observations",
                "observation",
                60,
                fk("telescope_id", "telescopes"),
                cat("target", ("mars", "vega", "andromeda", "orion")),
                num("hours", 1, 12, "duration in hours", additive=True),
            ),
        ),
    ),
)

DOMAINS = {domain.name: domain for domain in (*TRAIN_DOMAINS, *UNSEEN_DOMAINS)}
