//! The string form of a label selector (`?labelSelector=`): the lexer and the
//! recursive-descent parser of `k8s.io/apimachinery/pkg/labels`, behind
//! [`LabelSelector::parse`] and its [`FromStr`].

use std::str::FromStr;

use super::label::{LabelOp, LabelSelector, Requirement};
use super::validation::validate_key;
use super::{Result, SelectorError};

impl LabelSelector {
    /// Parses the string form of `?labelSelector=`. The empty string selects everything.
    pub fn parse(s: &str) -> Result<Self> {
        Parser::new(s).parse().map(Self::new)
    }
}

impl FromStr for LabelSelector {
    type Err = SelectorError;

    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenKind {
    Identifier,
    /// The keyword `in`; an identifier everywhere but in operator position.
    In,
    /// The keyword `notin`; an identifier everywhere but in operator position.
    NotIn,
    Bang,
    Equals,
    DoubleEquals,
    NotEquals,
    GreaterThan,
    LessThan,
    OpenParen,
    CloseParen,
    Comma,
    End,
}

#[derive(Debug, Clone, Copy)]
struct Token<'s> {
    kind: TokenKind,
    text: &'s str,
    offset: usize,
}

/// The whitespace Kubernetes' lexer skips; anything else non-special is part of an identifier.
fn is_whitespace(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

fn special_kind(c: char) -> Option<TokenKind> {
    Some(match c {
        '!' => TokenKind::Bang,
        '=' => TokenKind::Equals,
        '>' => TokenKind::GreaterThan,
        '<' => TokenKind::LessThan,
        '(' => TokenKind::OpenParen,
        ')' => TokenKind::CloseParen,
        ',' => TokenKind::Comma,
        _ => return None,
    })
}

fn tokenize(s: &str) -> Vec<Token<'_>> {
    let mut tokens = Vec::new();
    let mut chars = s.char_indices().peekable();
    while let Some(&(start, c)) = chars.peek() {
        if is_whitespace(c) {
            chars.next();
            continue;
        }
        let kind = if let Some(kind) = special_kind(c) {
            chars.next();
            // Longest match: `!=` and `==` are the only two-character symbols.
            match (kind, chars.peek()) {
                (TokenKind::Bang, Some((_, '='))) => {
                    chars.next();
                    TokenKind::NotEquals
                }
                (TokenKind::Equals, Some((_, '='))) => {
                    chars.next();
                    TokenKind::DoubleEquals
                }
                _ => kind,
            }
        } else {
            while chars
                .peek()
                .is_some_and(|&(_, c)| !is_whitespace(c) && special_kind(c).is_none())
            {
                chars.next();
            }
            TokenKind::Identifier
        };
        let end = chars.peek().map_or(s.len(), |&(i, _)| i);
        let text = &s[start..end];
        let kind = match (kind, text) {
            (TokenKind::Identifier, "in") => TokenKind::In,
            (TokenKind::Identifier, "notin") => TokenKind::NotIn,
            _ => kind,
        };
        tokens.push(Token {
            kind,
            text,
            offset: start,
        });
    }
    tokens
}

/// A recursive-descent parser over the tokens of a label selector string, following
/// the grammar of `k8s.io/apimachinery/pkg/labels`:
///
/// ```text
/// selector    ::= "" | requirement ("," requirement)*
/// requirement ::= "!" KEY | KEY [ ("="|"=="|"!="|">"|"<") [VALUE] | ("in"|"notin") "(" values ")" ]
/// values      ::= "" | VALUE-or-empty ("," VALUE-or-empty)*
/// ```
struct Parser<'s> {
    tokens: Vec<Token<'s>>,
    position: usize,
    end: Token<'s>,
}

impl<'s> Parser<'s> {
    fn new(s: &'s str) -> Self {
        Parser {
            tokens: tokenize(s),
            position: 0,
            end: Token {
                kind: TokenKind::End,
                text: "",
                offset: s.len(),
            },
        }
    }

    /// The next token, with keywords read as identifiers (the "values" context).
    fn peek(&self) -> Token<'s> {
        let mut token = self.peek_raw();
        if matches!(token.kind, TokenKind::In | TokenKind::NotIn) {
            token.kind = TokenKind::Identifier;
        }
        token
    }

    fn peek_raw(&self) -> Token<'s> {
        self.tokens.get(self.position).copied().unwrap_or(self.end)
    }

    fn next(&mut self) -> Token<'s> {
        let token = self.peek();
        self.position += 1;
        token
    }

    fn next_raw(&mut self) -> Token<'s> {
        let token = self.peek_raw();
        self.position += 1;
        token
    }

    fn parse(mut self) -> Result<Vec<Requirement>> {
        let mut requirements = Vec::new();
        loop {
            let token = self.peek();
            match token.kind {
                TokenKind::End => return Ok(requirements),
                TokenKind::Identifier | TokenKind::Bang => {}
                _ => return Err(syntax(token, "'!', identifier, or end of string")),
            }
            requirements.push(self.parse_requirement()?);
            let token = self.next();
            match token.kind {
                TokenKind::End => return Ok(requirements),
                TokenKind::Comma => {
                    let after = self.peek();
                    if !matches!(after.kind, TokenKind::Identifier | TokenKind::Bang) {
                        return Err(syntax(after, "'!' or identifier after ','"));
                    }
                }
                _ => return Err(syntax(token, "',' or end of string")),
            }
        }
    }

    fn parse_requirement(&mut self) -> Result<Requirement> {
        let mut token = self.next();
        let does_not_exist = token.kind == TokenKind::Bang;
        if does_not_exist {
            token = self.next();
        }
        if token.kind != TokenKind::Identifier {
            return Err(syntax(token, "identifier"));
        }
        let key = token.text;
        // Validate before looking further, so a bad key is reported as such rather than
        // as whatever syntax error follows it.
        validate_key(key).map_err(|reason| SelectorError::InvalidKey {
            key: key.to_owned(),
            reason,
        })?;
        if does_not_exist {
            // Anything after `!key` is left for the caller, which wants `,` or the end.
            return Requirement::new(key, LabelOp::DoesNotExist, None::<&str>);
        }
        if matches!(self.peek().kind, TokenKind::End | TokenKind::Comma) {
            return Requirement::new(key, LabelOp::Exists, None::<&str>);
        }

        let token = self.next_raw();
        let operator = match token.kind {
            TokenKind::Equals => LabelOp::Equals,
            TokenKind::DoubleEquals => LabelOp::DoubleEquals,
            TokenKind::NotEquals => LabelOp::NotEquals,
            TokenKind::GreaterThan => LabelOp::GreaterThan,
            TokenKind::LessThan => LabelOp::LessThan,
            TokenKind::In => LabelOp::In,
            TokenKind::NotIn => LabelOp::NotIn,
            _ => return Err(syntax(token, "one of =, ==, !=, in, notin, >, <")),
        };
        let values = match operator {
            LabelOp::In | LabelOp::NotIn => self.parse_value_set()?,
            _ => vec![self.parse_exact_value()?],
        };
        Requirement::new(key, operator, values)
    }

    /// `(a,b)`; an empty slot (`()`, `(,a)`, `(a,,b)`, `(a,)`) is the empty value.
    fn parse_value_set(&mut self) -> Result<Vec<&'s str>> {
        let token = self.next();
        if token.kind != TokenKind::OpenParen {
            return Err(syntax(token, "'('"));
        }
        let mut values = Vec::new();
        // Whether the slot before the next separator already holds a value.
        let mut filled = false;
        loop {
            let token = self.next();
            match token.kind {
                TokenKind::Identifier if !filled => {
                    values.push(token.text);
                    filled = true;
                }
                TokenKind::Identifier => return Err(syntax(token, "',' or ')'")),
                TokenKind::Comma => {
                    if !filled {
                        values.push("");
                    }
                    filled = false;
                }
                TokenKind::CloseParen => {
                    if !filled {
                        values.push("");
                    }
                    return Ok(values);
                }
                _ if filled => return Err(syntax(token, "',' or ')'")),
                _ => return Err(syntax(token, "',', ')' or identifier")),
            }
        }
    }

    /// The value after `=`, `==`, `!=`, `>` or `<`; nothing before `,` or the end is the
    /// empty value.
    fn parse_exact_value(&mut self) -> Result<&'s str> {
        let token = self.peek();
        match token.kind {
            TokenKind::End | TokenKind::Comma => Ok(""),
            TokenKind::Identifier => {
                self.next();
                Ok(token.text)
            }
            _ => Err(syntax(token, "identifier")),
        }
    }
}

fn syntax(token: Token<'_>, expected: &'static str) -> SelectorError {
    SelectorError::Syntax {
        position: token.offset,
        found: (token.kind != TokenKind::End).then(|| token.text.to_owned()),
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::test_support::{labels, only, parse, parse_err};

    #[test]
    fn parses_every_operator() {
        let cases: &[(&str, &str, LabelOp, &[&str])] = &[
            ("app=web", "app", LabelOp::Equals, &["web"]),
            ("app==web", "app", LabelOp::DoubleEquals, &["web"]),
            ("app!=web", "app", LabelOp::NotEquals, &["web"]),
            ("app in (web,db)", "app", LabelOp::In, &["db", "web"]),
            ("app notin (web)", "app", LabelOp::NotIn, &["web"]),
            ("app", "app", LabelOp::Exists, &[]),
            ("!app", "app", LabelOp::DoesNotExist, &[]),
            ("replicas>3", "replicas", LabelOp::GreaterThan, &["3"]),
            ("replicas<10", "replicas", LabelOp::LessThan, &["10"]),
        ];
        for (input, key, op, values) in cases {
            let sel = parse(input);
            assert_eq!(only(&sel), (*key, *op, values.to_vec()), "{input}");
        }
    }

    #[test]
    fn empty_and_blank_strings_select_everything() {
        for input in ["", " ", " \t\r\n "] {
            let sel = parse(input);
            assert!(sel.is_empty(), "{input:?}");
            assert!(sel.matches_map(&labels(&[("a", "b")])));
            assert_eq!(sel.to_string(), "");
        }
    }

    #[test]
    fn tolerates_whitespace_between_tokens() {
        let sel = parse("  a = b ,c in ( x , y ) , ! d,e  !=  f , g\tnotin(h)\n");
        assert_eq!(sel.to_string(), "a=b,c in (x,y),!d,e!=f,g notin (h)");
    }

    #[test]
    fn whitespace_inside_a_term_without_operator_is_an_error() {
        let err = parse_err("a b");
        assert!(err.contains("position 2"), "{err}");
        assert!(err.contains("found 'b'"), "{err}");
        assert!(err.contains("=, ==, !=, in, notin, >, <"), "{err}");
    }

    #[test]
    fn sorts_requirements_by_key() {
        let sel = parse("z=1,a,m in (x)");
        let keys: Vec<&str> = sel.requirements().iter().map(Requirement::key).collect();
        assert_eq!(keys, ["a", "m", "z"]);
    }

    #[test]
    fn missing_exact_value_is_the_empty_value() {
        let sel = parse("a=,b!=");
        assert_eq!(sel.requirements()[0].values(), [""]);
        assert_eq!(sel.requirements()[1].values(), [""]);
        assert!(sel.matches_map(&labels(&[("a", ""), ("b", "x")])));
        assert!(!sel.matches_map(&labels(&[("a", "x")])));
    }

    #[test]
    fn empty_slots_in_a_set_are_the_empty_value() {
        assert_eq!(only(&parse("a in ()")).2, [""]);
        assert_eq!(only(&parse("a in (,x)")).2, ["", "x"]);
        assert_eq!(only(&parse("a in (x,)")).2, ["", "x"]);
        assert_eq!(only(&parse("a in (x,,y)")).2, ["", "x", "y"]);
        assert_eq!(only(&parse("a in (,)")).2, [""]);
    }

    #[test]
    fn set_values_are_sorted_and_deduplicated() {
        assert_eq!(only(&parse("a in (c,b,c,a)")).2, ["a", "b", "c"]);
    }

    #[test]
    fn keywords_are_identifiers_outside_operator_position() {
        let sel = parse("in in (in,notin),notin=in");
        assert_eq!(sel.to_string(), "in in (in,notin),notin=in");
        assert!(sel.matches_map(&labels(&[("in", "notin"), ("notin", "in")])));
        assert_eq!(only(&parse("in")), ("in", LabelOp::Exists, vec![]));
        assert_eq!(
            only(&parse("!notin")),
            ("notin", LabelOp::DoesNotExist, vec![])
        );
    }

    #[test]
    fn keyword_glued_to_key_is_part_of_the_key() {
        // As in Kubernetes, `xin` is a single identifier, so the set has no operator.
        let err = parse_err("xin (a)");
        assert!(err.contains("found '('"), "{err}");
    }

    #[test]
    fn accepts_prefixed_keys() {
        let sel = parse("app.kubernetes.io/name=web,example.com/a_b-c.d");
        assert_eq!(
            sel.to_string(),
            "app.kubernetes.io/name=web,example.com/a_b-c.d"
        );
    }

    #[test]
    fn rejects_misplaced_commas() {
        let err = parse_err("a,");
        assert!(err.contains("found end of string"), "{err}");
        assert!(err.contains("after ','"), "{err}");
        let err = parse_err(",a");
        assert!(err.contains("position 0: found ','"), "{err}");
        let err = parse_err("a,,b");
        assert!(err.contains("position 2: found ','"), "{err}");
    }

    #[test]
    fn rejects_malformed_sets() {
        let err = parse_err("a in b");
        assert!(err.contains("found 'b', expected: '('"), "{err}");
        let err = parse_err("a in (b");
        assert!(
            err.contains("found end of string, expected: ',' or ')'"),
            "{err}"
        );
        let err = parse_err("a in (b c)");
        assert!(err.contains("position 8: found 'c'"), "{err}");
        let err = parse_err("a in (=)");
        assert!(
            err.contains("found '=', expected: ',', ')' or identifier"),
            "{err}"
        );
        let err = parse_err("a in");
        assert!(err.contains("found end of string, expected: '('"), "{err}");
    }

    #[test]
    fn rejects_trailing_tokens() {
        let err = parse_err("a=b c");
        assert!(
            err.contains("position 4: found 'c', expected: ',' or end of string"),
            "{err}"
        );
        let err = parse_err("a=(b)");
        assert!(err.contains("found '(', expected: identifier"), "{err}");
        let err = parse_err("a in (b))");
        assert!(
            err.contains("found ')', expected: ',' or end of string"),
            "{err}"
        );
    }

    #[test]
    fn rejects_operator_after_does_not_exist() {
        let err = parse_err("!a=b");
        assert!(err.contains("position 2: found '='"), "{err}");
        let err = parse_err("!");
        assert!(
            err.contains("found end of string, expected: identifier"),
            "{err}"
        );
        let err = parse_err("!!a");
        assert!(err.contains("found '!', expected: identifier"), "{err}");
    }

    #[test]
    fn rejects_a_requirement_starting_with_an_operator() {
        let err = parse_err("=a");
        assert!(
            err.contains("found '=', expected: '!', identifier"),
            "{err}"
        );
    }

    #[test]
    fn longest_match_lexes_not_equals_and_double_equals() {
        assert_eq!(only(&parse("a!=b")).1, LabelOp::NotEquals);
        assert_eq!(only(&parse("a==b")).1, LabelOp::DoubleEquals);
        // `===` is `==` then `=`, which is not a value.
        let err = parse_err("a===b");
        assert!(err.contains("found '=', expected: identifier"), "{err}");
    }

    #[test]
    fn syntax_errors_name_the_position() {
        let err = LabelSelector::parse("a=b,c in x").unwrap_err();
        assert_eq!(
            err,
            SelectorError::Syntax {
                position: 9,
                found: Some("x".to_owned()),
                expected: "'('",
            }
        );
        assert_eq!(
            err.to_string(),
            "unable to parse label selector: at position 9: found 'x', expected: '('"
        );
    }

    #[test]
    fn from_str_is_parse() {
        let sel: LabelSelector = "a=b".parse().unwrap();
        assert_eq!(sel, parse("a=b"));
    }
}
